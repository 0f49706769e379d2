"""The suite on several pytest-xdist workers (``make test``): launches of two workers never draw the same
rendezvous port, files that share one launch stay in one worker, and a worker's own ops take its share of the
cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from distributed import free_port

TESTS = Path(__file__).parent


def test_workers_draw_ports_from_disjoint_slices_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    drawn: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        drawn[worker] = {free_port() for _ in range(50)}
    every = drawn["gw0"] | drawn["gw1"]
    assert min(every) >= 20000 and max(every) < 32768  # Linux hands out 32768-60999 itself
    assert max(drawn["gw0"]) < min(drawn["gw1"])
    assert len(drawn["gw0"]) > 1  # a random start in the slice, not one port again and again


class _LoadFileConfig:
    """What xdist's schedulers read of the config, for ``-n 2 --dist <dist>``."""

    def __init__(self, dist: str) -> None:
        self.values = {"dist": dist, "tx": ["2*popen"]}

    def getvalue(self, name: str) -> Any:
        return self.values[name]


def test_files_that_share_a_launch_share_a_worker(request: pytest.FixtureRequest) -> None:
    scheduler = request.config.hook.pytest_xdist_make_scheduler(config=_LoadFileConfig("loadfile"), log=None)
    hf = "tests/models/hf"
    scopes = {
        scheduler._split_scope(f"{hf}/test_hf_pipeline.py::test_x[1F1B]"),
        scheduler._split_scope(f"{hf}/test_hf_checkpoints.py::test_y"),
        scheduler._split_scope(f"{hf}/test_hf_trainer.py::test_z"),
    }
    assert len(scopes) == 1
    assert scheduler._split_scope(f"{hf}/test_hf_refusals.py::test_a") == f"{hf}/test_hf_refusals.py"
    assert scheduler._split_scope("tests/test_parallel_suite.py::test_b") == "tests/test_parallel_suite.py"
    # another --dist is xdist's own
    assert request.config.hook.pytest_xdist_make_scheduler(config=_LoadFileConfig("load"), log=None) is None


def test_every_parity_module_is_a_test_file() -> None:
    sys.path.insert(0, str(TESTS / "models" / "hf"))
    try:
        from parity_modules import PARITY_MODULES
    finally:
        sys.path.pop(0)
    assert all((TESTS / "models" / "hf" / f"{name}.py").is_file() for name in PARITY_MODULES)


def test_a_worker_s_ops_take_its_share_of_the_cores() -> None:
    """On a machine of two or more cores (CI's two) a worker of two runs its ops on half of them."""
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import conftest, torch; print(torch.get_num_threads())"],
        cwd=TESTS,
        env={**environment, "PYTEST_XDIST_WORKER_COUNT": "2"},
        capture_output=True,
        text=True,
        check=True,
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert int(out.stdout.split()[-1]) == max(1, cores // 2)
