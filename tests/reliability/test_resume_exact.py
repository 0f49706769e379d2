"""A resumed run sees exactly the batches and random numbers the uninterrupted run would have, whichever way
its checkpoint was written: ``ModelCheckpoint`` during training, ``trainer.save_checkpoint`` during ``fit``, or
after ``fit`` stopped at ``max_steps`` inside an epoch (Lightning then marks the epoch done; see
``lightning_d9d/strategies/resume.py``) or at an epoch's end; on 1 and 2 processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).with_name("resume_runs.py")
STEPS = 10  # 8 batches an epoch on 1 rank, 4 on 2: every run crosses an epoch boundary
SAMPLES = 8
# (how the checkpoint is written, its step; None: the first epoch's last; the training loader: resume_runs.py's
# LOADERS). Mid-epoch also with loaders that keep their own position, which the strategy takes as they are (it
# puts the random states back itself): one of the user's, and torchdata's StatefulDataLoader.
CASES = [("callback", 3, "plain"), ("during", 3, "plain"), ("after", 3, "plain"), ("after", None, "plain")]
CASES += [("callback", 3, "own"), ("callback", 3, "stateful")]


def _first_run_steps(save: str, step: int) -> int:
    # "after" stops there; the others train on past the checkpoint, as a run that crashes later would
    return step if save == "after" else step + 2


def _runs(tmp: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str, int, str, Path]]]:
    runs: list[dict[str, Any]] = []
    cases = []
    for devices in (1, 2):
        runs.append(
            {"kind": "resume", "devices": devices, "max_steps": STEPS, "out": str(tmp / f"u{devices}.pt")}
        )
        for save, at, loader in CASES:
            step = at or SAMPLES // devices
            name = f"{save}{step}-{loader}-{devices}"
            ckpt = tmp / name / ("ckpts" if save == "callback" else "ckpt")
            first = {"kind": "resume", "devices": devices, "save": save, "save_step": step, "ckpt": str(ckpt)}
            first["loader"] = loader
            first.update(max_steps=_first_run_steps(save, step), out=str(tmp / f"{name}-first.pt"))
            resumed = {"kind": "resume", "devices": devices, "max_steps": STEPS, "resume_from": str(ckpt)}
            resumed["loader"] = loader
            resumed["out"] = str(tmp / f"{name}-resumed.pt")
            runs += [first, resumed]
            cases.append((devices, save, step, loader, tmp / name))
    return runs, cases


def _load(path: Path, rank: int) -> dict[str, Any]:
    return torch.load(path.with_name(f"{path.stem}-{rank}{path.suffix}"), weights_only=True)


def test_a_resume_continues_the_batches_and_random_streams_exactly(tmp_path: Path) -> None:
    runs, cases = _runs(tmp_path)
    subprocess.run([sys.executable, str(SCRIPT), json.dumps(runs)], check=True, timeout=600)
    for devices, save, step, loader, folder in cases:
        for rank in range(devices):
            straight = _load(tmp_path / f"u{devices}.pt", rank)
            first = _load(tmp_path / f"{folder.name}-first.pt", rank)
            resumed = _load(tmp_path / f"{folder.name}-resumed.pt", rank)
            where = f"{save} at step {step}, {loader} loader, {devices} process(es), rank {rank}"
            assert resumed["step"] == STEPS, where
            if loader == "stateful":  # taken as it is: Lightning saves and restores its position itself
                assert first["loader"] == resumed["loader"] == "StatefulDataLoader", where
            # the steps before the checkpoint, then the resumed ones, are the uninterrupted run's
            assert first["batches"][:step] + resumed["batches"] == straight["batches"], where
            assert first["draws"][:step] + resumed["draws"] == straight["draws"], where
            for name, value in straight["params"].items():
                torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=0, msg=where)
    assert len(straight["batches"]) == STEPS and len(set(straight["batches"][:4])) == 4
