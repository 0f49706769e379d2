"""A mid-epoch data position moves to another number of data-parallel ranks or another global batch when it
falls on a whole global batch of the new run, and is refused with both sizes named when it does not."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_d9d.strategies.data import ResumableDataLoader, resumable

DATA = TensorDataset(torch.arange(48))


def loader(replicas: int, rank: int, batch: int) -> ResumableDataLoader:
    sampler: DistributedSampler = DistributedSampler(DATA, num_replicas=replicas, rank=rank, seed=3)
    sampler.set_epoch(1)
    converted = resumable(DataLoader(DATA, batch_size=batch, sampler=sampler))
    assert isinstance(converted, ResumableDataLoader)
    return converted


def consumed(replicas: int, batch: int, batches: int) -> tuple[set[int], dict]:
    """The samples all ranks drew in their first ``batches`` batches, and the position rank 0 saves."""
    seen: set[int] = set()
    state: dict = {}
    for rank in range(replicas):
        run = loader(replicas, rank, batch)
        iterator = iter(run)
        for _ in range(batches):
            seen.update(int(i) for i in next(iterator)[0])
        state = state or run.state_dict()
    return seen, state


def rest(replicas: int, batch: int, state: dict) -> set[int]:
    """The samples all ranks of a run resumed from ``state`` draw in the rest of the epoch."""
    seen: set[int] = set()
    for rank in range(replicas):
        resumed = loader(replicas, rank, batch)
        resumed.load_state_dict(state)
        seen.update(int(i) for items in resumed for i in items[0])
    return seen


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [((2, 4), (1, 8)), ((1, 8), (2, 4)), ((2, 4), (1, 12)), ((2, 6), (3, 4))],
    ids=["dp2->dp1", "dp1->dp2", "global-batch-8->12", "dp2->dp3"],
)
def test_the_position_moves_to_another_layout(saved: tuple[int, int], resumed: tuple[int, int]) -> None:
    """(ranks, per-rank batch) saved after 3 global batches; the resumed run draws exactly the other samples."""
    before, state = consumed(*saved, batches=3)
    after = rest(*resumed, state)
    assert before.isdisjoint(after) and before | after == set(range(48))


def test_a_position_inside_a_new_global_batch_is_refused() -> None:
    _, state = consumed(2, 4, batches=3)  # 24 samples
    with pytest.raises(ValueError, match=r"24 samples into the epoch .* global batches of 16 .* divides 24"):
        loader(2, 0, 8).load_state_dict(state)
