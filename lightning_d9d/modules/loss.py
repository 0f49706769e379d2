"""Losses for language modelling.

A loss that is a mean over counted items (tokens) can say so: :class:`CountedLoss` adds ``count(target)``. The
d9d strategy then weights each microbatch and each data-parallel rank by its count, so that the loss and the
gradients are the mean over every counted item of the global batch, as one process would compute it, even when
padding (``ignore_index``) leaves ranks and microbatches with different numbers of tokens; under gradient
accumulation each optimizer step's gradient is the mean over every counted item of all its micro-steps
(:class:`~lightning_d9d.strategies.accumulation.StepTokens`). A plain ``loss_fn(output, target)`` is averaged per
microbatch, per rank and per micro-step instead (a mean of means).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class CountedLoss(Protocol):
    """``loss(output, target)`` is the mean over ``count(target)`` items (a 0-d integer tensor)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def count(self, target: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class InternalLosses(Protocol):
    """A model that adds losses of its own inside forward (MoE router losses) straight into the gradient. Their
    gradient must be scaled like the user's loss: the strategy calls ``set_router_loss_scale`` with the factor
    it applies to each (micro)batch's loss (``1 / (accumulation steps x pipeline microbatches)``, times the
    micro-step's token factor under token-weighted accumulation)."""

    def set_router_loss_scale(self, scale: float) -> None: ...


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(factor)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (factor,) = ctx.saved_tensors
        return grad * factor.to(grad.dtype), None


def scale_gradient(value: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``value`` unchanged (bit for bit), its gradient multiplied by ``factor`` (a 0-d tensor that stays on the
    device: nothing is read back to the host). Token-weighted gradient accumulation weighs a micro-step's
    gradient this way while the loss it logs stays the one it computed."""
    result: torch.Tensor = _ScaleGradient.apply(value, factor.detach())
    return result


class CausalLMLoss:
    """Mean next-token cross-entropy over the tokens whose label is not ``ignore_index``.

    ``labels`` are already shifted by the caller: ``logits[:, t]`` is scored against ``labels[:, t]``. The
    softmax runs in fp32 whatever the logits' dtype (bf16 log-sum-exp over a 150k vocabulary loses too much).
    A batch with no valid label gives 0 with zero gradients instead of NaN, so a fully padded microbatch
    does not poison the step.
    """

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of scored tokens (on the labels' device: reading it would synchronise the host)."""
        return (labels != self.ignore_index).sum()

    def __call__(self, logits: Any, labels: torch.Tensor, ignore_index: int | None = None) -> torch.Tensor:
        """The mean loss; ``ignore_index`` overrides the instance's for this call only. ``logits`` is a tensor,
        or a model output that holds one as ``.logits`` (a ``transformers`` causal LM's)."""
        skip = self.ignore_index if ignore_index is None else ignore_index
        if not isinstance(logits, torch.Tensor):
            held = getattr(logits, "logits", None)
            if not isinstance(held, torch.Tensor):
                raise TypeError(
                    f"causal LM loss: expected the logits (a tensor) or a model output with .logits, got "
                    f"{type(logits).__name__}"
                )
            logits = held
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]"
            )
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=skip,
            reduction="sum",
        )
        return total / (labels != skip).sum().clamp(min=1)

    def __repr__(self) -> str:
        return f"CausalLMLoss(ignore_index={self.ignore_index})"


causal_lm_loss = CausalLMLoss()
