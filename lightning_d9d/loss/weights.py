"""Token weighting: what a forward's loss weighs in the optimizer step, over ranks, microbatches and micro-steps.

A :class:`~lightning_d9d.modules.loss.CountedLoss` weighs each rank by its share of the items (tokens) of the global
batch (:func:`global_count`, :func:`item_scale`, :func:`weighed`), so that averaging over the data ranks gives the
mean over all items, as one process would; under pp the runner weighs each microbatch alike from the same scale.
Under token-weighted gradient accumulation a micro-step's gradient weighs by its items too (:class:`TokenWindow`:
the strategy's count of the optimizer step), and so do the losses a model adds inside its forward
(:func:`scale_internal_losses`). A plain loss weighs every rank, microbatch and micro-step the same.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.loss import CountedLoss, InternalLosses, scale_gradient
from lightning_d9d.pipeline.runner import LossFn


class TokenWindow(Protocol):
    """The counted items of one optimizer step's micro-steps, as token-weighted gradient accumulation keeps them
    (the Trainer strategy's :class:`~lightning_d9d.strategies.accumulation.StepTokens`)."""

    def add(self, count: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Count ``count`` items in this micro-step: the gradient factor of a loss over them, and whether they
        set the window's reference count (their factor is then exactly 1)."""
        ...

    def commit(self) -> torch.Tensor | None:
        """This micro-step's backward runs: its gradient factor, its items now in the step's count; None outside
        token-weighted accumulation."""
        ...


def global_count(
    dims: ParallelDims, loss_fn: LossFn, target: torch.Tensor, *, needed: bool, pipelined: bool
) -> torch.Tensor | None:
    """The items a counted loss counts in the global batch, over the ranks whose losses are averaged (on the
    device); None for a plain loss, or where nobody needs it (one process without pp or accumulation)."""
    if not isinstance(loss_fn, CountedLoss):
        return None
    mesh = dims.mesh_for("loss")
    if mesh.size() == 1 and not pipelined and not needed:
        return None
    count = loss_fn.count(target).to(torch.int64)
    if mesh.size() > 1:
        dist.all_reduce(count, group=mesh.get_group())  # no host sync: it stays on the device
    return count


def item_scale(dims: ParallelDims, count: torch.Tensor | None, *, pipelined: bool) -> torch.Tensor | None:
    """``ranks / items in the global batch`` over the ranks whose losses are averaged, for a counted loss
    (``count``: :func:`global_count`); None where every rank and microbatch weighs the same (a plain loss, or
    one process without pp)."""
    if count is None:
        return None
    mesh = dims.mesh_for("loss")
    if mesh.size() == 1 and not pipelined:
        return None
    return (mesh.size() / count.clamp(min=1)).float()


def weighed(
    loss: torch.Tensor, loss_fn: LossFn, target: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    """The loss times this rank's share of the counted items (``scale``: :func:`item_scale`)."""
    if scale is None:
        return loss
    counted: CountedLoss = loss_fn  # type: ignore[assignment]
    return loss * (counted.count(target) * scale)


def micro_step_gradient(loss: torch.Tensor, window: TokenWindow) -> torch.Tensor:
    """``loss`` as its backward runs: under token-weighted accumulation its gradient weighs this micro-step's
    ``N_m / R`` and its value stays; unchanged outside it."""
    factor = window.commit()
    return loss if factor is None else scale_gradient(loss, factor)


def scale_internal_losses(model: nn.Module, share: float, *, accumulate: int, microbatches: int) -> None:
    """Losses a model adds inside forward (MoE router losses) count once per optimizer step, as the user's loss
    does: scale them by ``share / (accumulation steps x microbatches)``. ``share`` is 1, or, under token-weighted
    accumulation, the micro-step's gradient factor ``N_m / R``: after the step's rescale by ``A R / N`` the router
    losses of micro-step ``m`` weigh ``N_m / N`` of ``1 / microbatches``, like its loss, and the step's router
    losses still weigh ``1 / microbatches`` in all (``1 / (A x microbatches)`` each when the micro-steps count the
    same tokens)."""
    if isinstance(model, InternalLosses):
        model.set_router_loss_scale(share / (accumulate * microbatches))
