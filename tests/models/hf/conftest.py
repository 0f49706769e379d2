"""One launch of ``hf_parity_run.py`` for every parity run of this folder's tests (each file lists its runs in
``RUNS``): the script's start-up (torch, Lightning, transformers) is paid once."""

from __future__ import annotations

from typing import Any

import pytest
from parity_modules import PARITY_MODULES


@pytest.fixture(scope="session")
def parity_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What every run saved, by ``"<module>/<run>"``."""
    import importlib

    from hf_parity_run import launch_parity_runs

    out = tmp_path_factory.mktemp("hf_parity")
    runs: dict[str, dict[str, Any]] = {}
    for name in PARITY_MODULES:
        module = importlib.import_module(name)
        prepare = getattr(module, "prepare_runs", None)
        listed = prepare(out) if prepare is not None else module.RUNS
        runs.update({f"{name}.{run}": config for run, config in listed.items()})
    return launch_parity_runs(runs, out)
