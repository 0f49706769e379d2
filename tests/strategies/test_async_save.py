"""``D9DStrategy(async_save=True)`` on 2 processes (gloo): saves written in the background change nothing in
training, every checkpoint is complete when ``fit`` returns, and resuming from one gives the uninterrupted run
bit for bit. ``ModelCheckpoint`` deletes an old checkpoint (``save_top_k``) only once the new one is complete,
and links ``last.ckpt`` (``save_last="link"``) only to a complete one. A crash (SIGKILL of every rank) while a
background write runs leaves the previous checkpoint complete, ``last.ckpt`` pointing at it, and both the folder
and ``ckpt_path="last"`` resume from it exactly. ``Preemption``'s checkpoint is complete before its requeue,
which ends the job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_trainer_parity import BASE, assert_same_training, run_trainer

from lightning_d9d.state import manifest
from lightning_d9d.state.selection import incomplete_reason, keep_reason, newest_complete

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
EVERY_STEP = {**ASYNC, "save_every": 1, "record_folder": True}

# ModelCheckpoint's settings, and the complete checkpoints its folder holds at each batch start (the moment the
# callbacks see, before the strategy completes the save of the step before): a save written after step k is
# complete from batch start k + 2 on, and the checkpoint it replaces is deleted only then; a crash at any of
# these moments resumes from what is listed. Then the folder when fit returns.
KEEPING: dict[str, tuple[dict, list[list[str]], list[str]]] = {
    "keep_one": (
        {"keep": 1},
        [[], [], ["step=1.ckpt"], ["step=2.ckpt"], ["step=3.ckpt"], ["step=4.ckpt"]],
        ["step=6.ckpt"],
    ),
    "keep_two": (
        {"keep": 2},
        [[], [], ["step=1.ckpt"]] + [[f"step={step - 1}.ckpt", f"step={step}.ckpt"] for step in range(2, 5)],
        ["step=5.ckpt", "step=6.ckpt"],
    ),
    # last.ckpt is a save of its own: the step's save completes before it starts; the one at the end of the last
    # epoch is synchronous and completes the one in flight first
    "keep_one_last": (
        {"keep": 1, "save_last": True},
        [[], ["step=1.ckpt"]] + [["last.ckpt", f"step={step}.ckpt"] for step in range(2, 6)],
        ["last.ckpt", "step=6.ckpt"],
    ),
    "keep_one_link": (
        {"keep": 1, "save_last": "link"},
        [[], []] + [[f"last.ckpt->step={step}.ckpt", f"step={step}.ckpt"] for step in range(1, 5)],
        ["last.ckpt->step=6.ckpt", "step=6.ckpt"],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("async_save")
    # one launch (its imports paid once): the resume on 2 new ranks ("new_ranks"), not those that saved
    configs = [
        {**RUN, "ckpt_dir": str(tmp / "sync")},
        {**ASYNC, "ckpt_dir": str(tmp / "async")},
        *(
            {**EVERY_STEP, **settings, "ckpt_dir": str(tmp / name)}
            for name, (settings, _, _) in KEEPING.items()
        ),
        {**ASYNC, "save_every": 0, "resume_from": str(tmp / "async" / "step=2.ckpt"), "new_ranks": True},
    ]
    names = ["sync", "async", *KEEPING, "resumed"]
    done = run_trainer(configs, tmp, "saves", names=names, fork=True)
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


def listing(folder: Path) -> list[str]:
    """Every entry of ``folder``, hidden ones too, sorted by name, a link shown with its target."""
    return sorted(
        entry.name + (f"->{os.readlink(entry)}" if entry.is_symlink() else "") for entry in folder.iterdir()
    )


@pytest.mark.parametrize("name", list(KEEPING))
def test_a_checkpoint_is_deleted_or_linked_only_once_its_successor_is_complete(runs: dict, name: str) -> None:
    _, at_batch_starts, at_the_end = KEEPING[name]
    got, folder = runs[name], runs["tmp"] / name
    assert got["folder_at_batch_start"] == at_batch_starts
    assert listing(folder) == at_the_end  # no temporary directory left either
    assert all(incomplete_reason(folder / entry.split("->")[0]) is None for entry in at_the_end)
    assert got["losses"] == runs["sync"]["losses"]  # the saves and deletions change nothing in training


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two runs that die, in one launch, each on ranks of its own ("dies"); what they left on disk; then, in a
    second launch, the resumes from it."""
    tmp = tmp_path_factory.mktemp("async_crash")
    link, preempted = tmp / "link", tmp / "preempted"
    dying = [
        {
            **EVERY_STEP,
            "keep": 1,
            "save_last": "link",
            "ckpt_dir": str(link),
            "slow_write": {"marker": "step=4", "seconds": 30},  # step 4's write is still running ...
            "kill_at_step": 5,  # ... when every rank is killed, a step later
            "dies": True,
        },
        {
            **ASYNC,
            "save_every": 0,
            "ckpt_dir": str(preempted),
            "preempt": {"rank": 1, "step": 3, "at": "backward"},
            "slow_write": {"marker": "preempted", "seconds": 1},  # the write still runs when the save returns
            "requeue_ends_the_job": True,
            "dies": True,
        },
    ]
    died = run_trainer(dying, tmp, "crash", names=["link", "preempted"], fork=True)
    left = {"link": listing(link), "preempted": listing(preempted)}
    resolved = newest_complete(link)[0].resolve().name  # what fit(ckpt_path=<the folder>) picks
    resumes = [
        # ckpt_path="last" as Lightning resolves it: the newest last*.ckpt of the ModelCheckpoint's folder
        {**ASYNC, "save_every": 100, "ckpt_dir": str(link), "resume_from": "last"},
        {**ASYNC, "save_every": 0, "resume_from": str(preempted)},
    ]
    resumed = run_trainer(resumes, tmp, "after_crash", names=["link", "preempted"], fork=True)
    return {"died": died, "left": left, "resolved": resolved, "resumed": resumed}


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(runs: dict, crashes: dict) -> None:
    assert crashes["died"]["link"] == {"killed_at": 5}
    visible = [name for name in crashes["left"]["link"] if not name.startswith(".")]
    # step=3 is deleted, and last.ckpt linked to step=4, only once step=4 is complete: never
    assert visible == ["last.ckpt->step=3.ckpt", "step=3.ckpt"]
    interrupted = [name for name in crashes["left"]["link"] if name.startswith(".step=4.ckpt.tmp-")]
    assert len(interrupted) == 1  # the write the crash interrupted, never a candidate
    assert crashes["resolved"] == "step=3.ckpt"  # the folder resumes from it too
    resumed, full = crashes["resumed"]["link"], runs["sync"]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][3:], "params": full["params"]},
        tolerance=0.0,
    )


def test_a_preemption_checkpoint_is_complete_before_the_requeue_ends_the_job(
    runs: dict, crashes: dict
) -> None:
    died = crashes["died"]["preempted"]
    assert died["global_step"] == 3 and Path(died["preempted"]).name == "preempted-step=3.ckpt"
    assert incomplete_reason(Path(died["preempted"])) is None
    assert crashes["left"]["preempted"] == ["preempted-step=3.ckpt"]
    resumed, full = crashes["resumed"]["preempted"], runs["sync"]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][3:], "params": full["params"]},
        tolerance=0.0,
    )


def complete_checkpoint(path: Path) -> Path:
    """A directory that passes the cheap completeness check (a manifest listing its one file, with its size)."""
    path.mkdir(parents=True)
    (path / "meta.pt").write_bytes(b"state")
    manifest.write_manifest(path, {"meta.pt": manifest.checksum(path / "meta.pt")})
    return path


def test_a_link_to_the_only_complete_checkpoint_is_not_another_one(tmp_path: Path) -> None:
    only = complete_checkpoint(tmp_path / "step=3.ckpt")
    (tmp_path / "last.ckpt").symlink_to("step=3.ckpt")
    assert keep_reason(only) == f"{only} is the only complete checkpoint in {tmp_path}"
    complete_checkpoint(tmp_path / "step=4.ckpt")
    assert keep_reason(only) is None
