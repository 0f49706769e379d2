"""The benchmark scripts' folder goes on ``sys.path`` (their tests import them): no script may share its name
with an installed top-level module, or every later import of that module in the test process gets the script
(``benchmarks/kernels.py`` once hid the ``kernels`` package that ``transformers`` >= 5.25 imports)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_benchmark_script_shadows_an_installed_module() -> None:
    installed = importlib.metadata.packages_distributions()
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert "train_throughput" in scripts  # the folder was found
    assert not sorted(scripts & set(installed)), "rename these scripts: installed modules have their names"
