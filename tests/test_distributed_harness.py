"""The test launcher itself (``tests/distributed.py``): a rank that crashes is reported as the crash, not as the
closed connection its peers then see, and a libc-style crash is started anew once (in fresh processes) before it
fails the test."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed import RankCrashed, run_distributed, run_launched

# the process that imported this module: the test process for a forked rank, the rank itself for a spawned one
_IMPORTED_BY = os.getpid()


def _aborts_when_forked() -> int:
    """Crashes as a forked rank does when the test process's state is bad; a fresh process is fine."""
    if os.getpid() != _IMPORTED_BY:
        faulthandler.disable()
        os.kill(os.getpid(), signal.SIGABRT)
    return dist.get_rank()


def _rank0_aborts() -> int:
    if dist.get_rank() == 0:
        faulthandler.disable()  # pytest's would print this rank's stack
        os.kill(os.getpid(), signal.SIGABRT)  # as glibc does on a corrupted heap
    dist.barrier()  # rank 1 waits on a peer that is gone
    return dist.get_rank()


def _rank0_dies_slowly_after_rank1_loses_it() -> int:
    """Rank 1 reports the lost connection at once; rank 0's death by SIGABRT comes seconds later (as when its
    core takes long to write)."""
    if os.getpid() != _IMPORTED_BY:
        if dist.get_rank() == 1:
            raise RuntimeError("Connection reset by peer")
        time.sleep(4)
        faulthandler.disable()
        os.kill(os.getpid(), signal.SIGABRT)
    return dist.get_rank()


def test_a_peers_slow_crash_is_reported_and_retried_not_the_lost_connection() -> None:
    with pytest.warns(UserWarning, match=r"rank 0 died with exit code -6 .*again once \(spawn\)"):
        assert run_distributed(_rank0_dies_slowly_after_rank1_loses_it, 2, timeout=120) == [0, 1]


def test_a_crashed_rank_is_reported_as_the_crash_after_one_retry() -> None:
    with (
        pytest.warns(UserWarning, match="rank 0 died with exit code -6 before reporting a result; starting"),
        pytest.raises(RankCrashed, match="rank 0 died with exit code -6") as crash,
    ):
        run_distributed(_rank0_aborts, 2, timeout=60)
    assert crash.value.exitcode == -signal.SIGABRT


def test_the_retry_of_a_crashed_fork_starts_fresh_processes() -> None:
    with pytest.warns(UserWarning, match=r"exit code -6 .*again once \(spawn\)"):
        assert run_distributed(_aborts_when_forked, 2, timeout=120) == [0, 1]


def test_ranks_that_succeed_report_their_results() -> None:
    assert run_distributed(dist.get_rank, 2) == [0, 1]


def test_a_launched_command_whose_rank_died_by_signal_runs_again_once(tmp_path: Path) -> None:
    # torchrun's summary of a rank killed by SIGABRT the first time, success the second
    first_time = tmp_path / "ran"
    script = (
        "import pathlib, sys\n"
        f"marker = pathlib.Path({str(first_time)!r})\n"
        "if not marker.exists():\n"
        "    marker.touch()\n"
        "    print('  exitcode  : -6 (pid: 1)  (SIGABRT)', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        "print('trained')\n"
    )
    with pytest.warns(UserWarning, match="died by signal"):
        done = run_launched([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "trained"


def test_a_launched_command_that_fails_otherwise_is_not_run_again(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    script = (
        f"import pathlib, sys\np = pathlib.Path({str(counter)!r})\n"
        "p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else '1')\n"
        "print('  exitcode  : 1 (pid: 1)', file=sys.stderr)\nsys.exit(1)\n"
    )
    done = run_launched([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 1 and counter.read_text() == "1"
