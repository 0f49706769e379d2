"""Asynchronous checkpoint saves for ``D9DStrategy(async_save=True)``: training goes on while the tensors are
written, and the atomic protocol is kept.

A save during training copies the model and optimizer state to CPU memory (on CUDA into pinned buffers kept for
the next save, copied without a host round trip per tensor: the optimizer state is handed over on the GPU, see
``D9DStrategy.optimizer_state``) and hands the write to a background thread
(:func:`lightning_d9d.state.training.save_async`, on torch's ``async_save``), followed by this rank's share of the
checksums in another; its collectives run over a gloo group of its own, so they never interleave with the
training thread's. The checkpoint appears under its name only when the write is complete: at the first batch
start at which every rank's write and checksums have ended (one all-reduce of a flag per batch on a second gloo
group while a save is pending: a few bytes on the CPU, no GPU synchronisation), the ranks finish it together in
the main thread: ``meta.pt``, the manifest last, then the move into place
(:class:`~lightning_d9d.state.training.PendingSave`). A crash before that leaves the
previous checkpoint complete and the new one a hidden temporary directory, never a candidate for resuming.

The next save waits for the previous one, and so does the end of training. A save outside the training loop (a
``trainer.save_checkpoint`` after ``fit``, or ``ModelCheckpoint``'s at the end of the last epoch) is synchronous,
and completes the one in flight first.

``ModelCheckpoint`` acts on a new checkpoint as soon as ``save_checkpoint`` returns: it deletes the one it replaces
(``save_top_k``) and links ``last.ckpt`` to it (``save_last="link"``). While the save is in flight both wait for it
to be complete (the link first: ``last.ckpt`` never points at a checkpoint that is not complete or gone), and a
deletion then re-checks that it leaves another complete checkpoint; a crash before leaves the folder as a
synchronous save would have: the previous checkpoint, and ``last.ckpt`` linked to it. A failed save drops them.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from lightning_d9d.compat import replace_checkpoint_linker
from lightning_d9d.state import training as training_checkpoint

log = logging.getLogger("lightning_d9d.strategies")


class AsyncSaves:
    """The one save in flight, if any, and the two gloo groups (the write's, the vote's)."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout  # the strategy's collective timeout, for the groups made here too
        self.pending: training_checkpoint.PendingSave | None = None
        self._write_group: dist.ProcessGroup | None = None
        self._vote_group: dist.ProcessGroup | None = None
        self._stager: BlockingAsyncStager | None = None  # its pinned buffers serve every save of the run
        # what waits for the save in flight to be complete, in order: links to it, then deletions
        self._links: list[Callable[[], None]] = []
        self._removals: list[tuple[Path, Callable[[Path], None]]] = []
        self._linking: list[ModelCheckpoint] = []  # the callbacks whose links go through link()

    def setup(self) -> None:
        """Create the groups: a collective of the default group, once, before training."""
        if not dist.is_initialized() or self._write_group is not None:
            return
        # also on one rank: torch's async save needs a CPU backend, and the default group may be NCCL alone
        self._write_group = dist.new_group(backend="gloo", timeout=self.timeout)
        if dist.get_world_size() > 1:
            self._vote_group = dist.new_group(backend="gloo", timeout=self.timeout)

    def save(self, path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> None:
        """Finish the save in flight (its write still reads the stager's buffers), then start this one."""
        started = time.perf_counter()
        self.finish()
        finished = time.perf_counter()
        if self._stager is None:
            # on CUDA the first save allocates pinned CPU buffers shaped like the state, later saves copy into
            # them (device-to-host at full speed, no allocation); torch's DefaultStager deep-copies CUDA
            # DTensors' specs, which failed on the H200 (KeyError: <class 'type'>)
            self._stager = BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())
        self.pending = training_checkpoint.save_async(
            Path(path), checkpoint, self._write_group, stager=self._stager
        )
        # what the training thread paid: waiting for the previous save, copying the state to CPU memory
        log.info(
            "async save of %s: waited %.2f s for the previous save, staged in %.2f s",
            path,
            finished - started,
            time.perf_counter() - finished,
        )

    def poll(self) -> None:
        """Finish the save in flight if every rank's write has ended (every rank calls it at the same point)."""
        if self.pending is None:
            return
        done = self.pending.done()
        if self._vote_group is not None:
            vote = torch.tensor([int(done)], dtype=torch.int32)
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self._vote_group)
            done = bool(vote.item())
        if done:
            self.finish()

    def finish(self) -> None:
        """Wait for the write in flight and put its checkpoint in place (a collective), then make the links and
        deletions that waited for it."""
        pending, self.pending = self.pending, None
        links, self._links = self._links, []
        removals, self._removals = self._removals, []
        if pending is None:
            return
        path = pending.finish()  # a failure raises here: what waited is dropped with the checkpoint
        log.info("async save: %s is complete", path)
        for link in links:
            link()
        for removed, remove in removals:
            if removed.absolute() == path:  # the deletion meant the checkpoint this save replaced
                log.info("not deleting %s: it was saved again after the deletion was asked for", path)
                continue
            remove(removed)

    def remove_when_complete(self, path: Path, remove: Callable[[Path], None]) -> bool:
        """While a save is in flight, queue ``remove(path)`` for when it is complete (``remove`` re-checks that
        another complete checkpoint remains) and return True; else return False: delete now."""
        if self.pending is None:
            return False
        self._removals.append((path, remove))
        return True

    def link_when_complete(self, callbacks: Iterable[object]) -> None:
        """Route the ``last.ckpt`` links of the ``ModelCheckpoint(save_last="link")`` callbacks among ``callbacks``
        through :meth:`link` until :meth:`restore_links`."""
        for callback in callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
                replace_checkpoint_linker(callback, self.link)
                self._linking.append(callback)

    def restore_links(self) -> None:
        """Give the callbacks of :meth:`link_when_complete` Lightning's own linking back."""
        for callback in self._linking:
            replace_checkpoint_linker(callback, None)
        self._linking.clear()

    def link(self, trainer: pl.Trainer, target: str, link: str) -> None:
        """``link`` -> ``target``, once ``target`` is complete: queued while the save in flight writes it."""
        if os.path.abspath(target) == os.path.abspath(link):
            return  # the newest checkpoint is last.ckpt itself: nothing to link (Lightning's own check)
        if self.pending is not None and Path(target).absolute() == self.pending.final:
            self._links.append(lambda: replace_link(trainer, Path(target), Path(link)))
            return
        replace_link(trainer, Path(target), Path(link))

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers (the end of training)."""
        self.finish()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def abandon(self) -> None:
        """After a failure elsewhere: wait for this rank's write to end (its thread holds the staged tensors),
        and leave the checkpoint unfinished: finishing needs every rank, which may be gone."""
        pending, self.pending = self.pending, None
        removals, self._links, self._removals = self._removals, [], []
        if pending is not None:
            try:
                pending.wait()
            except Exception as error:  # the run is failing already: this is not its reason
                log.warning("async save of %s failed too: %s", pending.final, error)
        for removed, _ in removals:
            log.warning("not deleting %s: the save that was to replace it did not complete", removed)


def replace_link(trainer: pl.Trainer, target: Path, link: Path) -> None:
    """Rank 0 points ``link`` at ``target`` (a relative link, as Lightning makes them) in one rename over an older
    link: ``link`` is never missing or dangling meanwhile. Anything else at ``link`` is removed first, as
    Lightning does."""
    if not trainer.is_global_zero:
        return
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    temporary = link.with_name(f".{link.name}.link-{secrets.token_hex(4)}")
    temporary.symlink_to(os.path.relpath(target, link.parent))
    os.replace(temporary, link)
