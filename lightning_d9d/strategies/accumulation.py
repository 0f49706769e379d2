"""Token-weighted gradient accumulation: what one optimizer step's micro-steps counted, and the rescale that
makes the step's gradient their token mean."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class MicroStep:
    """A training batch under automatic optimization, as gradient accumulation sees it."""

    index: int  # the batch's index over the fit (Lightning's ``total_batch_idx``)
    accumulate: int  # micro-steps per optimizer step (``accumulate_grad_batches``, ``A``)
    opens_window: (
        bool  # the first of its window, where Lightning zeroes the gradients: ``batch_idx % A == 0``
    )


def micro_steps_per_step(module: Any) -> int:
    """``accumulate_grad_batches`` of ``module``'s trainer: the micro-steps of one optimizer step (1 outside a
    Trainer)."""
    from lightning_d9d.compat import trainer_of  # imports Lightning: not at this module's import

    trainer = trainer_of(module) if module is not None else None
    return trainer.accumulate_grad_batches if trainer is not None else 1


def current_micro_step(module: Any) -> MicroStep | None:
    """The training micro-step ``module``'s trainer runs; None outside training under automatic optimization,
    where no window groups the steps (each stands alone). The one place the accumulation window is computed."""
    from lightning_d9d.compat import trainer_of  # imports Lightning: not at this module's import

    trainer = trainer_of(module) if module is not None else None
    if trainer is None or not trainer.training or not module.automatic_optimization:
        return None
    loop, accumulate = trainer.fit_loop.epoch_loop, trainer.accumulate_grad_batches
    return MicroStep(loop.total_batch_idx, accumulate, opens_window=loop.batch_idx % accumulate == 0)


class StepTokens:
    """Token-weighted gradient accumulation: the counted items (tokens) of one optimizer step's micro-steps.

    Lightning divides each micro-step's loss by ``accumulate_grad_batches`` (``A``): micro-steps weigh the
    same, a mean of their token means. For a :class:`~lightning_d9d.modules.loss.CountedLoss` the strategy
    weighs them by their items instead, so that the step's gradient is the mean over every counted item of all
    its micro-steps, data-parallel ranks and pipeline microbatches, as one process would compute it on the
    whole step (torchtitan divides by the step's token count too). The later micro-steps' counts are unknown
    when the first one runs backward, so:

    - micro-step ``m``, with ``N_m`` items over the ranks whose losses are averaged, multiplies its gradient by
      ``N_m / R`` (:meth:`add` gives the factor, :meth:`commit` takes the count into the step when its backward
      runs); ``R`` is the window's first count. Without pp the factor scales the whole closure loss's gradient
      (another term the user adds to the loss weighs as the loss does), under pp the schedule's losses; MoE
      router losses get it through ``set_router_loss_scale``. The loss value returned and logged is unchanged;
    - after the last micro-step's backward, before ``on_before_optimizer_step`` and clipping,
      :meth:`rescale` multiplies every gradient by ``A R / N`` (``N``: the step's items): micro-step ``m`` then
      weighs ``N_m / N``. The hook ``on_after_backward`` sees the gradients before this rescale.

    Counts and factors stay on the device: nothing is read back to the host, except by a model with router
    losses (their scale is a float: one read of ``N_m / R`` per micro-step after the first). With equal counts
    every factor is exactly 1. A window that ends early (the last batches of an epoch) is the token mean of its
    micro-steps. Exact for any layout; what no look-ahead allows is a loss term that must weigh ``1 / A`` per
    micro-step whatever the counts: every term of a micro-step weighs ``N_m / N``.
    """

    def __init__(self) -> None:
        self.accumulate = 1
        self.reference: Tensor | None = None  # R: the first counted micro-step's items (at least 1)
        self.total: Tensor | None = None  # N so far: the items of the micro-steps whose backward ran
        self.pending: Tensor | None = None  # this micro-step's items, until its backward
        self._micro_step: int | None = None

    def reset(self) -> None:
        self.reference = self.total = self.pending = None

    def enter(self, module: Any, *, counted: bool) -> bool:
        """Whether the loss being computed in ``module``'s trainer weighs by its share of the optimizer step's
        items: a counted loss (``counted``) with gradients, in training, under automatic optimization and
        ``accumulate_grad_batches > 1``. If so, records which micro-step this is and whether it opens an
        accumulation window (:func:`current_micro_step`)."""
        step = current_micro_step(module)
        if not counted or step is None or not torch.is_grad_enabled() or step.accumulate == 1:
            return False
        self.micro_step(step.index, opens_window=step.opens_window, accumulate=step.accumulate)
        return True

    def micro_step(self, index: int, *, opens_window: bool, accumulate: int) -> None:
        """A counted loss of training micro-step ``index`` (the batch index over the fit) is computed;
        ``opens_window``: it is the first of an accumulation window."""
        if index == self._micro_step:
            return  # another counted loss of the same micro-step
        self._micro_step = index
        self.accumulate = accumulate
        self.pending = None  # a micro-step whose training_step returned no loss had no backward
        if opens_window:
            self.reset()

    def add(self, count: Tensor) -> tuple[Tensor, bool]:
        """Count ``count`` items (a 0-d integer tensor) in this micro-step; returns the gradient factor of a
        loss over them (``count / R``) and whether they set ``R`` (their factor is then 1: no need to read it)."""
        count = count.to(torch.int64)
        is_reference = self.reference is None
        if self.reference is None:
            self.reference = count.clamp(min=1)
        self.pending = count if self.pending is None else self.pending + count
        return count.float() / self.reference.float(), is_reference

    def commit(self) -> Tensor | None:
        """This micro-step's backward runs: its gradient factor (``N_m / R``), its items now in the step's
        count. None outside token-weighted accumulation. A backward without a counted loss in a window that
        has one counts ``R`` items, with factor 1."""
        if self.reference is None:
            return None
        count = self.pending if self.pending is not None else self.reference
        self.pending = None
        self.total = count if self.total is None else self.total + count
        return count.float() / self.reference.float()

    def rescale(self, parameters: Iterable[Tensor]) -> None:
        """The step's backward is done: gradients times ``A R / N``, and a new step begins. Scales each
        gradient's local tensor (a DTensor's shard), which is right for every placement."""
        reference, total, accumulate = self.reference, self.total, self.accumulate
        self.reset()
        if reference is None or total is None:
            return
        scale = reference.float() * accumulate / total.clamp(min=1).float()
        with torch.no_grad():
            for param in parameters:
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                local.mul_(scale.to(local.device))
