"""Fault injection: a rank SIGKILLed at each point of a save (and once mid-step, outside any save); a fresh run
on the same folder resumes from the newest complete checkpoint and ends exactly where an uninterrupted run does.

Two forked gloo ranks, a tiny FSDP model (``kill_points.py``); one uninterrupted run is the reference for all,
and one launch resumes every killed run's folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kill_points import (
    KILL_POINTS,
    SAVE_AT,
    STEPS,
    launch,
    resume_each,
    save_with_rank_1_dying_before_commit,
    train,
)

from lightning_d9d.state import manifest
from lightning_d9d.state.training import read_meta


def _entries(folder: Path) -> dict[str, int | str]:
    """Each entry of ``folder``: the step of a complete checkpoint (sizes and checksums checked), else why not."""
    found: dict[str, int | str] = {}
    for entry in sorted(folder.iterdir()):
        try:
            manifest.verify(entry)
            found[entry.name] = int(read_meta(entry, weights_only=True)["global_step"])
        except Exception as error:
            found[entry.name] = f"{type(error).__name__}: {error}"
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{"uninterrupted": result, point: (what each rank of the killed run returned, the resumed result)}``,
    and ``"after_kill"``: each point's folder (``_entries``) between the kill and the resume."""
    root = tmp_path_factory.mktemp("faults")
    uninterrupted = launch(root / "uninterrupted", train, str(root / "uninterrupted_ckpt"), None, False)[0]
    assert uninterrupted is not None, "the uninterrupted run failed"
    killed, after_kill = {}, {}
    for point in KILL_POINTS:
        killed[point] = launch(root / f"{point}_killed", train, str(root / point), point, False)
        after_kill[point] = _entries(root / point)
    resumed = launch(root / "resumed", resume_each, [str(root / point) for point in KILL_POINTS])[0]
    assert resumed is not None, [path.read_text() for path in root.glob("resumed.*.error")]
    results: dict = {point: (killed[point], resumed[str(root / point)]) for point in KILL_POINTS}
    return {**results, "uninterrupted": uninterrupted, "root": root, "after_kill": after_kill}


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_fresh_run_resumes_from_the_last_complete_checkpoint(point: str, runs: dict) -> None:
    victim, expected_step = KILL_POINTS[point]
    killed, run = runs[point]
    assert killed[victim] is None, f"rank {victim} was to die at {point!r} but finished"
    assert "error" not in run, run.get("error")
    assert (runs["root"] / point / run["resumed_from"]).is_dir()
    assert run["losses"].keys() == set(range(expected_step + 1, STEPS + 1)), (
        f"resumed after step {min(run['losses']) - 1}, expected {expected_step}"
    )
    uninterrupted = runs["uninterrupted"]
    for step, loss in run["losses"].items():
        assert loss == uninterrupted["losses"][step], (
            f"step {step}: {loss} vs {uninterrupted['losses'][step]}"
        )
    for name, value in uninterrupted["params"].items():
        assert torch.equal(run["params"][name], value), name
    # the resumed run's save of the last step replaced "last", cleaning up after the killed save
    left = _entries(runs["root"] / point)
    assert left["last"] == STEPS, left
    assert not [name for name in left if name.startswith(".last.")], left


def test_a_kill_between_the_renames_leaves_the_previous_last_aside_until_the_next_save(runs: dict) -> None:
    """Killed after ``last`` was renamed aside and before the new one was renamed in: the previous ``last``
    (step 2) is hidden, complete, and the only copy; the next save of ``last`` puts it back, then replaces it."""
    after_kill = runs["after_kill"]["between_the_renames"]
    assert "last" not in after_kill, after_kill
    hidden = [name for name in after_kill if name.startswith(".last.old-")]
    assert len(hidden) == 1, f"the previous last is not aside: {after_kill}"
    assert after_kill[hidden[0]] == SAVE_AT[0], (
        f"{hidden[0]} is not the complete step-{SAVE_AT[0]} checkpoint"
    )
    left = _entries(runs["root"] / "between_the_renames")
    assert left["last"] == STEPS, left  # back, replaced by the resumed run's save
    assert not [name for name in left if name.startswith(".last.old-")], left


def test_a_rank_dying_in_the_exchange_is_named_by_the_survivor(tmp_path: Path) -> None:
    survivor, dead = launch(
        tmp_path / "exchange", save_with_rank_1_dying_before_commit, str(tmp_path), stop_others=False
    )
    assert dead is None
    assert survivor.startswith("CheckpointError: finishing "), survivor
    assert (
        "the exchange of the ranks' outcomes (all_gather_object) over the 2 ranks of the default group failed "
        "on rank 0: rank 1 did not arrive" in survivor
    ), survivor
