"""``D9DStrategy(async_save=True)`` on 2 processes (gloo): saves written in the background change nothing in
training, every checkpoint is complete when ``fit`` returns, and resuming from one gives the uninterrupted run
bit for bit; a crash (SIGKILL of every rank) while a background write runs leaves the previous checkpoint
complete and the folder resumes from it, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_parity import BASE, assert_same_training, run_trainer

from lightning_d9d.state.selection import newest_complete

STEPS = 6
RUN = {
    **BASE,
    "devices": 2,
    "dp": 2,
    "max_steps": STEPS,
    "schedule_steps": STEPS,
    "steps_per_epoch": 4,  # step 2 is mid-epoch
    "save_every": 2,
}
ASYNC = {**RUN, "dims": {"async_save": True}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("async_save")
    # one launch (its imports paid once): the resume on 2 new ranks ("new_ranks"), not those that saved
    configs = [
        {**RUN, "ckpt_dir": str(tmp / "sync")},
        {**ASYNC, "ckpt_dir": str(tmp / "async")},
        {**ASYNC, "save_every": 0, "resume_from": str(tmp / "async" / "step=2.ckpt"), "new_ranks": True},
    ]
    done = run_trainer(configs, tmp, "saves", names=["sync", "async", "resumed"], fork=True)
    return {"tmp": tmp, **done}


def test_background_saves_change_nothing_and_are_complete_when_fit_returns(runs: dict) -> None:
    assert_same_training(runs["async"], runs["sync"], tolerance=0.0)
    assert runs["async"]["grad_norms"] == runs["sync"]["grad_norms"]
    folder = runs["tmp"] / "async"
    assert sorted(p.name for p in folder.iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert all(
        (folder / name / "manifest.json").is_file() for name in ("step=2.ckpt", "step=4.ckpt", "step=6.ckpt")
    )


def test_resuming_from_a_background_save_is_the_uninterrupted_run(runs: dict) -> None:
    full, resumed = runs["sync"], runs["resumed"]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][2:], "params": full["params"]},
        tolerance=0.0,
    )
    assert resumed["grad_norms"] == full["grad_norms"][2:]


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(runs: dict, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    crashing = {
        **ASYNC,
        "ckpt_dir": str(folder),
        "slow_write": {"marker": "step=4", "seconds": 30},  # the second save's write is still running ...
        "kill_at_step": 5,  # ... when every rank is killed, a step later
    }
    with pytest.raises(AssertionError, match="failed"):
        run_trainer(crashing, tmp_path, "crash", fork=True)
    visible = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert visible == ["step=2.ckpt"]  # the interrupted one is a hidden temporary directory, not a checkpoint
    assert any(p.name.startswith(".") for p in folder.iterdir())
    assert newest_complete(folder)[0].name == "step=2.ckpt"
    resumed = run_trainer(
        {**ASYNC, "save_every": 0, "resume_from": str(folder)}, tmp_path, "after_crash", fork=True
    )
    full = runs["sync"]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][2:], "params": full["params"]},
        tolerance=0.0,
    )
