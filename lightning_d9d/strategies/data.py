"""A training DataLoader that resumes mid-epoch at the next batch instead of replaying the epoch.

Lightning saves the ``state_dict()`` of every training loader that has one into the checkpoint (its
``CombinedLoader``) and hands it back through ``load_state_dict`` before the first ``iter()`` after a resume.
A plain ``DataLoader`` has none, so a checkpoint saved mid-epoch resumes at batch 0 of that epoch: the model
sees those batches twice and never sees the rest. :class:`ResumableDataLoader` counts the batches it has
yielded in the current pass and, after a restore, skips that many at the sampler (indices only: no sample
is loaded just to be thrown away).

The skip keeps the sampler's own order, so it is exact for Lightning's ``DistributedSampler`` (the permutation
depends on seed and epoch only, and Lightning sets the epoch before the first batch is drawn). The position is
saved as batches of a global batch (per-rank batch x ranks), so it moves to another number of data-parallel
ranks, or another global batch, whenever it falls on a whole global batch of the new run; otherwise loading it
raises an error naming both sizes (the ranks would have to split a batch).

torchdata's ``StatefulDataLoader`` keeps its position too, and Lightning saves and restores it the same way: a
user's ``StatefulDataLoader`` is taken as it is (:func:`resumable` leaves every loader but a plain ``DataLoader``
alone). The conversion is for plain loaders, so that a run resumes exactly without a change to the user's code or
another dependency, and so that the position survives a change of the data-parallel size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

if TYPE_CHECKING:
    from lightning_d9d.strategies.resume import PendingRandomState

_STATE_KEY = "batches_yielded"
_BATCH_KEY = "global_batch_size"  # per-rank batch x ranks of the run that saved the position


class SkippingSampler(Sampler[Any]):
    """``sampler`` with the first ``skip`` indices of the next pass left out (then back to whole passes)."""

    def __init__(self, sampler: Iterable[Any]) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        # A generator: the inner sampler's order is drawn at the first ``next``, after Lightning's set_epoch.
        skip, self.skip = self.skip, 0
        yield from itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict``/``load_state_dict``: the number of batches yielded in this pass.

    ``len()`` stays the whole epoch, as Lightning expects of a resumed loader (it counts the restored batches
    itself); only the next ``iter()`` after ``load_state_dict`` is shorter.

    ``random_state`` (set by the strategy): the checkpoint's random states, put back so that the training
    step draws what the uninterrupted run drew. A pass that resumes mid-epoch puts them back once its first
    batch is drawn (the uninterrupted run created no iterator there). One that starts at an epoch boundary
    creates its iterator from them (the uninterrupted run drew the new epoch's base seed from these states),
    and puts back the states of right after that once its first batch is drawn (Lightning's resume creates the
    validation iterator in between, which the uninterrupted run did not).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, SkippingSampler) or self.batch_size is None:
            raise TypeError(
                "ResumableDataLoader needs sampler=SkippingSampler(...) and a batch_size; "
                "build it with resumable(dataloader)"
            )
        self._yielded = 0
        self._resume_at = 0
        self._restored = False  # load_state_dict ran, and no batch was drawn since
        self.random_state: PendingRandomState | None = None

    # A counting generator instead of torch's iterator object: nothing in Lightning's loop uses more than next().
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        start, self._resume_at = self._resume_at, 0
        assert isinstance(self.sampler, SkippingSampler) and self.batch_size is not None
        # BatchSampler cuts consecutive indices into batches, so n batches are n * batch_size indices.
        self.sampler.skip = start * self.batch_size
        self._yielded = start
        boundary_states = self.random_state if self._restored and start == 0 else None
        if boundary_states is not None:
            boundary_states.restore(keep=True)  # this iterator draws the uninterrupted run's seed
        iterator = super().__iter__()
        if boundary_states is not None:
            boundary_states.capture()  # the states after that seed draw
        return self._count(iterator)

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            if self._restored:
                self._restored = False
                if self.random_state is not None:
                    self.random_state.restore()
            yield batch

    def _global_batch(self) -> int:
        assert self.batch_size is not None and isinstance(self.sampler, SkippingSampler)
        return self.batch_size * int(getattr(self.sampler.sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, int]:
        return {_STATE_KEY: self._yielded, _BATCH_KEY: self._global_batch()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        yielded = int(state[_STATE_KEY])
        self._restored = True
        saved, current = int(state.get(_BATCH_KEY, self._global_batch())), self._global_batch()
        samples = yielded * saved
        if yielded == 0 or (saved == current and yielded >= len(self)) or samples >= len(self) * current:
            # A pass that was used up (a checkpoint at the end of an epoch) resumes with a new whole pass.
            self._resume_at = 0
            return
        if samples % current:
            raise ValueError(
                f"the checkpoint's data position is {samples} samples into the epoch ({yielded} batches of a "
                f"global batch of {saved}), which is not a whole number of this run's global batches of "
                f"{current} (per-rank batch {self.batch_size} x data-parallel ranks): resume with a global "
                f"batch that divides {samples}, or from a checkpoint at an epoch boundary"
            )
        self._resume_at = samples // current


def resumable(dataloader: object) -> object:
    """``dataloader`` as a :class:`ResumableDataLoader`, or unchanged where a skip could not be exact.

    Converted: a plain ``torch.utils.data.DataLoader`` over a map-style dataset that batches with
    ``batch_size`` (its own ``BatchSampler``). Left alone: loaders that keep their own position (torchdata's
    ``StatefulDataLoader``, any loader with a ``state_dict``: Lightning saves and restores it), other ``DataLoader``
    subclasses and custom batch samplers (their constructor arguments are unknown), iterable datasets (no indices
    to skip). Lightning warns when a loader without a ``state_dict`` is resumed mid-epoch.
    """
    if type(dataloader) is not DataLoader:
        return dataloader
    loader: DataLoader = dataloader
    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        return loader
    return ResumableDataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=SkippingSampler(loader.sampler),
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )
