"""``GarbageCollection``: Python's cyclic garbage collector at fixed steps instead of whenever it triggers.

The automatic collector starts when allocation counters cross thresholds: at an unpredictable step, and its
oldest generation walks every object the process holds (compiled graphs, modules, thousands of tensors), which
can stall the host for hundreds of milliseconds while the GPU runs dry. Across ranks the stalls fall on
different steps, so every collective waits for whichever rank is collecting. Collecting the young generations
every ``every_n_steps`` steps on every rank, and the whole heap once before training, keeps the pauses short,
predictable and aligned (torchtitan's trainer does the same).
"""

from __future__ import annotations

import gc
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class GarbageCollection(Callback):
    """Disable automatic garbage collection for ``fit``; collect ``generation`` (0-2) every ``every_n_steps``
    optimizer steps, and everything once at the start. The collector's previous state returns after ``fit``,
    also when it fails."""

    def __init__(self, every_n_steps: int = 50, generation: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"GarbageCollection: every_n_steps={every_n_steps} must be a positive integer")
        if generation not in (0, 1, 2):
            raise ValueError(f"GarbageCollection: generation={generation} must be 0, 1 or 2")
        self.every_n_steps = every_n_steps
        self.generation = generation
        self._was_enabled: bool | None = None
        self._last_collected_step = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Optimizer steps: with accumulation, one collection per step, not per batch.
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_collected_step:
            self._last_collected_step = step
            gc.collect(self.generation)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
