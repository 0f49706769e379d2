"""The resumable training loader on its own (the Trainer runs are in test_trainer_parity.py)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_d9d.strategies.data import ResumableDataLoader, resumable

DATA = TensorDataset(torch.arange(24))


def first_items(batches: list) -> list[int]:
    return [int(batch[0][0]) for batch in batches]


def loader(epoch: int = 0) -> ResumableDataLoader:
    sampler: DistributedSampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(epoch)  # as Lightning does before each epoch
    converted = resumable(DataLoader(DATA, batch_size=2, sampler=sampler))
    assert isinstance(converted, ResumableDataLoader)
    return converted


def test_a_restored_loader_continues_at_the_next_batch_of_the_same_epoch() -> None:
    whole = first_items(list(loader(epoch=1)))
    interrupted = loader(epoch=1)
    iterator = iter(interrupted)
    consumed = [next(iterator) for _ in range(4)]
    state = interrupted.state_dict()
    assert state == {"batches_yielded": 4, "global_batch_size": 4}
    restored = loader(epoch=1)
    restored.load_state_dict(state)
    assert len(restored) == len(whole)  # Lightning counts the restored batches itself
    assert first_items(consumed) + first_items(list(restored)) == whole
    assert first_items(list(restored)) == whole  # only the first pass after a restore is shortened


def test_a_used_up_epoch_restores_to_a_whole_pass() -> None:
    done = loader()
    list(done)
    restored = loader()
    restored.load_state_dict(done.state_dict())
    assert len(list(restored)) == len(done)


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def test_loaders_it_cannot_skip_exactly_are_left_alone() -> None:
    class Custom(DataLoader):
        pass

    for dataloader in (
        DataLoader(Stream(), batch_size=2),  # no indices to skip
        DataLoader(DATA, batch_size=None),  # no batching: a custom collation of single items
        Custom(DATA, batch_size=2),  # unknown constructor arguments
    ):
        assert resumable(dataloader) is dataloader


def test_a_stateful_dataloader_is_taken_as_it_is() -> None:
    # torchdata's loader keeps its own position, which Lightning saves and restores (tests/reliability/
    # test_resume_exact.py resumes a Trainer run with one), with its own sampler or one Lightning puts in.
    from torchdata.stateful_dataloader import StatefulDataLoader

    for dataloader in (
        StatefulDataLoader(DATA, batch_size=2),
        StatefulDataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, num_replicas=2, rank=0)),
    ):
        assert resumable(dataloader) is dataloader
