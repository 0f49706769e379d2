"""``make install-torch``'s fallback chain, run for real against a fake ``pip`` that accepts only some routes.

Set-up must not dead-end where the CPU build ``torch==2.13.0+cpu`` cannot be had (a machine that reaches only
PyPI, a Python without that wheel): it falls back to PyPI's torch and says what it installed and why."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# The fake pip: logs (index, requirement) of each `pip install`, and succeeds only for the accepted ones.
FAKE_PIP = """\
import json, os, sys
args = sys.argv[1:]
index = args[args.index("--index-url") + 1] if "--index-url" in args else None
attempt = [index, args[-1]]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(attempt) + "\\n")
sys.exit(0 if attempt in json.loads(os.environ["FAKE_PIP_ACCEPT"]) else 1)
"""


def install_torch(
    tmp_path: Path, accept: list[list[str | None]], has_gpu: str = ""
) -> tuple[subprocess.CompletedProcess[str], list[list[str | None]]]:
    fake = tmp_path / "pip.py"
    fake.write_text(FAKE_PIP)
    log = tmp_path / "pip.log"
    log.touch()
    make = shutil.which("make")
    assert make is not None, "GNU make is needed: .ci/run and the README's set-up use it"
    done = subprocess.run(
        [make, "-s", "-C", str(ROOT), "install-torch", f"PIP={sys.executable} {fake}", f"HAS_GPU={has_gpu}"],
        env={"PATH": "/usr/bin:/bin", "FAKE_PIP_LOG": str(log), "FAKE_PIP_ACCEPT": json.dumps(accept)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, [json.loads(line) for line in log.read_text().splitlines()]


CPU_LOCAL = [None, "torch==2.13.0+cpu"]
CPU_FROM_PYTORCH = [CPU_INDEX, "torch==2.13.0+cpu"]
PYPI_PINNED = [None, "torch==2.13.0"]
PYPI_RANGE = [None, "torch>=2.11,<2.14"]


def test_the_cpu_build_from_the_configured_index_is_tried_first(tmp_path: Path) -> None:
    done, attempts = install_torch(tmp_path, accept=[CPU_LOCAL, PYPI_PINNED])
    assert done.returncode == 0, done.stderr
    assert attempts == [CPU_LOCAL]
    assert done.stdout.strip() == "torch: installed torch==2.13.0+cpu"


def test_pytorch_cpu_index_when_the_configured_index_lacks_the_cpu_build(tmp_path: Path) -> None:
    done, attempts = install_torch(tmp_path, accept=[CPU_FROM_PYTORCH, PYPI_PINNED])
    assert done.returncode == 0, done.stderr
    assert attempts == [CPU_LOCAL, CPU_FROM_PYTORCH]
    assert f"torch: installed torch==2.13.0+cpu from {CPU_INDEX}" in done.stdout


def test_pypi_torch_when_no_cpu_build_can_be_had(tmp_path: Path) -> None:
    # A machine that reaches only PyPI: neither CPU route works; PyPI's torch==2.13.0 does, and make says so.
    done, attempts = install_torch(tmp_path, accept=[PYPI_PINNED, PYPI_RANGE])
    assert done.returncode == 0, done.stderr
    assert attempts == [CPU_LOCAL, CPU_FROM_PYTORCH, PYPI_PINNED]
    assert "torch: NOTE: installed torch==2.13.0 instead of torch==2.13.0+cpu" in done.stdout
    assert "PyPI's torch is the CUDA build" in done.stdout


def test_the_tested_range_when_this_python_has_no_2_13_wheel(tmp_path: Path) -> None:
    done, attempts = install_torch(tmp_path, accept=[PYPI_RANGE])
    assert done.returncode == 0, done.stderr
    assert attempts == [CPU_LOCAL, CPU_FROM_PYTORCH, PYPI_PINNED, PYPI_RANGE]
    assert "torch: NOTE: installed torch>=2.11,<2.14 instead of torch==2.13.0+cpu" in done.stdout


def test_an_error_that_names_every_route_when_nothing_installs(tmp_path: Path) -> None:
    done, attempts = install_torch(tmp_path, accept=[])
    assert done.returncode != 0
    assert attempts == [CPU_LOCAL, CPU_FROM_PYTORCH, PYPI_PINNED, PYPI_RANGE]
    assert "torch: ERROR: could not install torch: tried torch==2.13.0+cpu" in done.stderr
    assert "then torch==2.13.0 torch>=2.11,<2.14 (configured index)" in done.stderr


@pytest.mark.parametrize("accept", [[PYPI_RANGE], []])
def test_with_a_gpu_only_the_tested_range_and_never_the_cpu_build(
    tmp_path: Path, accept: list[list[str | None]]
) -> None:
    done, attempts = install_torch(tmp_path, accept=accept, has_gpu="1")
    assert attempts == [PYPI_RANGE]
    assert (done.returncode == 0) == bool(accept)
