"""``Preemption``: on the signal a cluster sends before it kills a job, stop at the next optimizer-step boundary
that every rank agrees on, write a complete checkpoint, and end ``fit`` cleanly (then requeue under SLURM).

The signal handler only notes the signal: a handler runs between two Python bytecodes of whatever the rank was
doing (inside a forward, between two collectives of a backward), where saving a sharded checkpoint, or any
collective, would deadlock or mix steps. Lightning's own SLURM handler does exactly that (it saves from inside
the handler, and its SIGTERM handler broadcasts from it), so this callback takes the signals it handles over
from Lightning for the length of the training loop.

Agreement: after every optimizer step each rank contributes whether it has seen a signal to one all-reduce (MAX)
on a gloo group of its own, a few bytes on the CPU: no GPU synchronisation, and every rank learns the same answer
at the same step, whichever rank the signal reached and whenever in the step it came. Then every rank calls
``trainer.save_checkpoint`` (the strategy's atomic, sharded save: the directory appears complete or not at all)
and sets ``trainer.should_stop``, so ``fit`` returns normally after this step. The next run resumes with
``fit(ckpt_path=<that checkpoint>, or the folder>)``: the strategy's resume continues at the next batch with the
random states of the uninterrupted run, so the resumed run is the uninterrupted one bit for bit.

Under Lightning's ``SLURMEnvironment`` with ``auto_requeue`` (its default), rank 0 then asks SLURM to requeue the
job (``scontrol requeue``), as Lightning's own handler would have. The requeue ends the job (SIGTERM to every task,
which Lightning turns into ``SIGTERMException``, then SIGKILL): a checkpoint the strategy writes in the background
(``D9DStrategy(async_save=True)``) is completed first, so ``saved`` names a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

log = logging.getLogger("lightning_d9d.callbacks")


@runtime_checkable
class SavesInBackground(Protocol):
    """A strategy whose ``save_checkpoint`` may return before the checkpoint is complete (``D9DStrategy``)."""

    def finish_pending_saves(self) -> None:
        """Complete the checkpoint being written (a collective: every rank calls it)."""


class Preemption(Callback):
    """Stop on ``signals`` (default: SIGUSR1, what SLURM sends with ``--signal``; add ``signal.SIGTERM`` where the
    cluster sends that first) at the next optimizer step every rank agrees on, and save a checkpoint named
    ``filename`` (``{step}`` is the optimizer step) in ``dirpath`` (default: the first ``ModelCheckpoint``'s
    folder, else ``<default_root_dir>/checkpoints``). ``saved`` holds the path once written."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGUSR1,),
        filename: str = "preempted-step={step}.ckpt",
        requeue: bool = True,
    ) -> None:
        if not signals:
            raise ValueError("Preemption(signals=...) needs at least one signal to stop on")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.signals = tuple(signals)
        self.filename = filename
        self.requeue = requeue
        self.saved: Path | None = None
        self._received = False
        self._previous: dict[signal.Signals, Any] = {}
        self._group: dist.ProcessGroup | None = None
        self._last_step: int | None = None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._received = True  # nothing else here: see the module docstring

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._received, self.saved, self._last_step = False, None, trainer.global_step
        for signum in self.signals:  # after Lightning registered its handlers: ours replace them for the loop
            self._previous[signum] = signal.signal(signum, self._note)
        if dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            # a CPU group for the per-step vote: under NCCL a GPU all-reduce read on the host would wait
            # for the GPU at every step
            # with the strategy's collective timeout (D9DStrategy(timeout=...)), as every group it makes
            timeout = getattr(trainer.strategy, "_timeout", None)
            self._group = dist.new_group(
                backend="gloo", timeout=timeout if isinstance(timeout, timedelta) else None
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-step: the boundary is the optimizer step
        self._last_step = trainer.global_step
        if not self._agreed():
            return
        path = self._directory(trainer) / self.filename.format(step=trainer.global_step)
        log.warning("preemption signal: saving %s and stopping after step %d", path, trainer.global_step)
        trainer.save_checkpoint(path)
        # complete on disk before anything that may end the process: the requeue below, a SIGTERM
        if isinstance(trainer.strategy, SavesInBackground):
            trainer.strategy.finish_pending_saves()
        self.saved = path
        trainer.should_stop = True
        if self.requeue and trainer.is_global_zero:
            _requeue(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _agreed(self) -> bool:
        """Whether any rank has seen a signal by this step boundary (every rank gets the same answer)."""
        if self._group is None:
            return self._received
        vote = torch.tensor([int(self._received)], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote.item())

    def _directory(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"


def _requeue(trainer: pl.Trainer) -> None:
    """``scontrol requeue`` for this job, where Lightning's SLURM environment with ``auto_requeue`` runs it."""
    environment = trainer._accelerator_connector.cluster_environment
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not job:
        return
    try:
        done = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
    except FileNotFoundError:
        log.warning("preemption: scontrol is not on PATH, so job %s was not requeued", job)
        return
    if done.returncode != 0:
        log.warning("preemption: scontrol requeue %s failed: %s", job, done.stderr.strip())
