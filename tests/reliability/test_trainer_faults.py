"""Faults in ``Trainer(strategy="d9d")`` runs (``trainer_faults.py``, one launch for all):

- FSDP on 2 processes checkpointing every 7 steps, rank 1 SIGKILLed mid-step 8; a half-written newer checkpoint
  left in the folder. ``fit(ckpt_path=<the folder>)`` on 1 process (dp 2 -> 1) skips it with a log line, resumes
  from step 7 (mid-epoch), trains to step 14 and ends like 14 uninterrupted steps of the single-process loop.
- ``NonFiniteGuard``: one rank's gradient turned NaN at step 3 on 2 processes; ``"skip"`` leaves the parameters
  of that step alone on every rank and trains on, ``"raise"`` stops every rank naming step and parameter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from reference import reference_run
from test_trainer_parity import BASE, TOLERANCE, assert_same_training

from lightning_d9d.state import manifest

SCRIPT = Path(__file__).with_name("trainer_faults.py")
# 4-batch epochs: step 7 is three batches into the second epoch; the LR schedule spans the 14 steps
RUN = {
    **BASE,
    "kind": "faults",
    "steps_per_epoch": 4,
    "max_steps": 14,
    "schedule_steps": 14,
    "dp": 2,
    "devices": 2,
}
POISONED = "model.model.layers.1.mlp.down_proj.weight"
GUARD = {**RUN, "max_steps": 4, "schedule_steps": 8, "poison": {"rank": 1, "step": 3, "parameter": POISONED}}


def launch(runs: list[dict], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(SCRIPT), json.dumps(runs)]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("trainer_faults")
    folder = tmp / "ckpt"
    killed = {
        **RUN,
        "save_every": 7,
        "ckpt_dir": str(folder),
        "kill": {"rank": 1, "step": 8},
        "may_fail": True,
        "out": str(tmp / "killed.pt"),
    }
    guards = [
        {**GUARD, "guard": "skip", "out": str(tmp / "skip.pt")},
        {**GUARD, "guard": "raise", "out": str(tmp / "raise.pt")},
    ]
    first = launch([killed, *guards], tmp)
    saved = sorted(path.name for path in folder.iterdir())
    # what a save cut off by the kill would leave if renames were not atomic: a newer, incomplete checkpoint
    shutil.copytree(folder / "step=7.ckpt", folder / "step=8.ckpt", copy_function=shutil.copy)  # new mtimes
    (folder / "step=8.ckpt" / manifest.MANIFEST_NAME).unlink()
    resumed_config = {
        **RUN,
        "devices": 1,
        "dp": 1,
        "resume_from": str(folder),
        "out": str(tmp / "resumed.pt"),
    }
    second = launch([resumed_config], tmp)
    result = {
        name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in ("skip", "raise", "resumed")
    }
    return {
        **result,
        "killed_finished": (tmp / "killed.pt").exists(),
        "saved": saved,
        "first_stderr": first.stderr,
        "resume_stderr": second.stderr,
        "folder": folder,
    }


def test_a_run_killed_mid_step_resumes_from_a_folder_on_one_process(runs: dict) -> None:
    assert not runs["killed_finished"], "rank 1 was to die at step 8"
    assert runs["saved"] == ["step=7.ckpt"]
    stderr, folder = runs["resume_stderr"], runs["folder"]
    assert f"skipping checkpoint {folder / 'step=8.ckpt'}" in stderr and "is incomplete" in stderr
    assert f"resuming from {folder / 'step=7.ckpt'}" in stderr
    expected = reference_run(RUN)  # the 14 uninterrupted steps, as one process computes them
    resumed = runs["resumed"]
    assert len(resumed["losses"]) == 7
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": expected["losses"][7:], "params": expected["params"]},
        tolerance=TOLERANCE,  # dp 2 -> 1 sums gradients in another order
    )


def test_guard_skips_the_step_with_a_nan_gradient_on_every_rank(runs: dict) -> None:
    skip = runs["skip"]
    assert skip["skipped"] == [2]  # the global step before step 3's update
    assert skip["changed"] == [True, True, False, True]
    assert all(bool(torch.isfinite(value).all()) for value in skip["params"].values())


def test_guard_raises_naming_the_step_and_the_parameter(runs: dict) -> None:
    message = runs["raise"]["error"]
    assert message.startswith("non-finite values at global step 2:")
    assert f"rank 1: 1 parameters with non-finite gradients, first {POISONED!r}" in message
    assert "rank 0:" not in message  # the NaN came after FSDP's reduce-scatter: in rank 1's shard only
    assert runs["raise"]["changed"] == [True, True]  # stopped before step 3's update
