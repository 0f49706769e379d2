"""A rank that never reaches one of our collectives: the others raise within the process group's timeout,
naming the collective and the missing rank (2 forked gloo ranks, a 1 s timeout; rank 1 stays alive, away)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_d9d.mesh.arrival import CollectiveError, named_collective
from lightning_d9d.state.atomic import agree
from lightning_d9d.state.errors import CheckpointError
from lightning_d9d.strategies.guards import check_step

TIMEOUT = timedelta(seconds=1)
AWAY = 3.5  # rank 1's absence: longer than the timeout, so rank 0 fails by the timeout, not a closed peer


def _guard_step(module: torch.nn.Module) -> str | None:
    module.weight.grad = torch.ones_like(module.weight)
    return check_step(module, True, step=5)


def guard_with_rank_1_away() -> tuple[float, str]:
    """One guard step together, then rank 1 stays away from the next: what rank 0 raises, and after how long."""
    module = torch.nn.Linear(2, 2)
    assert _guard_step(module) is None  # both ranks arrive: a finite step passes
    if dist.get_rank() == 1:
        time.sleep(AWAY)
        return 0.0, "away"
    start = time.monotonic()
    try:
        _guard_step(module)
    except CollectiveError as error:
        assert error.missing == [1]
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, "no error"


def checkpoint_agreement_with_rank_1_away() -> tuple[float, str]:
    if dist.get_rank() == 1:
        time.sleep(AWAY)
        return 0.0, "away"
    start = time.monotonic()
    try:
        agree(lambda: "checked", distributed=True)
    except CheckpointError as error:
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, "no error"


def test_the_guard_names_its_collective_and_the_rank_that_never_came() -> None:
    (elapsed, message), away = run_distributed(guard_with_rank_1_away, 2, group_timeout=TIMEOUT)
    assert away == (0.0, "away")
    assert message.startswith(
        "CollectiveError: the non-finite guard's all_reduce over the 2 ranks of the default group failed on "
        "rank 0: rank 1 did not arrive"
    ), message
    assert "D9DStrategy(timeout=...)" in message
    assert TIMEOUT.total_seconds() - 0.2 <= elapsed < AWAY - 1, elapsed  # by the timeout, not rank 1's return


def test_the_checkpoint_agreement_names_its_collective_and_the_rank_that_never_came() -> None:
    (elapsed, message), _ = run_distributed(checkpoint_agreement_with_rank_1_away, 2, group_timeout=TIMEOUT)
    assert message.startswith(
        "CheckpointError: agreeing on the checks of a checkpoint: the exchange of the ranks'"
    )
    assert "failed on rank 0: rank 1 did not arrive" in message, message
    assert elapsed < AWAY - 1, elapsed


def group_collective_with_rank_1_away() -> tuple[float, str]:
    """As the pipeline's same-batch check runs: over a group of its own (here of both ranks)."""
    group = dist.new_group(
        [0, 1], timeout=TIMEOUT
    )  # a new group takes torch's default, not the default group's
    if dist.get_rank() == 1:
        time.sleep(AWAY)
        return 0.0, "away"
    start = time.monotonic()
    try:
        with named_collective("a check over a subgroup", group):
            dist.all_reduce(torch.ones(1), group=group)
    except CollectiveError as error:
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, "no error"


def test_a_collective_over_a_subgroup_names_the_group_and_the_rank_that_never_came() -> None:
    (elapsed, message), _ = run_distributed(group_collective_with_rank_1_away, 2, group_timeout=TIMEOUT)
    assert message.startswith(
        "CollectiveError: a check over a subgroup over the 2 ranks of the group of ranks [0, 1] failed on rank 0: "
        "rank 1 did not arrive"
    ), message
    assert elapsed < AWAY - 1, elapsed


def mesh_groups_with_rank_0_away() -> tuple[str, float, str]:
    """4 ranks as dp_shard=2 x tp=2 with ep=2, the mesh built with a 1 s timeout while the default group keeps
    60 s. Rank 0 stays away; rank 1 waits for it on an expert-mesh group (ep {0, 1}), rank 2 on a flattened view
    (loss {0, 2}), rank 3 on a mesh dim over part of the ranks (tp {2, 3}, for rank 2, itself stuck): how long
    until each raises, and what."""
    from lightning_d9d.mesh import ParallelDims

    dims = ParallelDims(dp_shard=2, tp=2, ep=2).resolve(4).build_mesh("cpu", timeout=TIMEOUT)
    view = {1: "ep", 2: "loss", 3: "tp"}.get(dist.get_rank())
    if view is None:
        time.sleep(AWAY)
        return "away", 0.0, ""
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=dims.mesh_for(view).get_group())
    except RuntimeError as error:
        return view, time.monotonic() - start, f"{type(error).__name__}: {str(error)[:120]}"
    return view, time.monotonic() - start, "no error"


def test_every_mesh_group_takes_the_strategy_timeout() -> None:
    """``D9DStrategy(timeout=...)`` reaches the mesh's own groups (a dim over part of the ranks, a flattened view,
    the expert mesh): without it torch gives each such gloo group 30 minutes, so the waiting ranks would fail
    only when rank 0 left (3.5 s, a closed connection); with it each raises after about the timeout."""
    results = run_distributed(mesh_groups_with_rank_0_away, 4, group_timeout=timedelta(seconds=60))
    assert results[0][0] == "away"
    for view, seconds, error in results[1:]:
        assert error.startswith("RuntimeError") and 0.8 <= seconds <= 2.5, (view, seconds, error)
    assert [view for view, _, _ in results[1:]] == ["ep", "loss", "tp"]
