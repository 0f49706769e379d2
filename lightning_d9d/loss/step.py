"""One forward's loss as both d9d strategies compute it: the one path from a strategy's ``model_loss`` down.

:func:`compute_loss` checks the inputs, cuts this rank's part of the sequence under cp, counts the tokens of the
global batch, takes the micro-step's share of token-weighted accumulation, scales a model's internal losses, and
runs the loss: :func:`~lightning_d9d.loss.forward.forward_loss` without a pipeline, or the pipeline runner's step
(the hand-off below: the runner is given the inputs, the labels, the token scale, the gradient factor and whether
its last stage computes the loss fused, and never calls back up). The strategies only say how they run
(:class:`LossContext`): the Lightning-facing parts (the Trainer's accumulation window, the memory report) stay theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from lightning_d9d.loss.forward import context_split, forward_loss
from lightning_d9d.loss.head import fused_ignore_index
from lightning_d9d.loss.weights import (
    TokenWindow,
    global_count,
    item_scale,
    scale_internal_losses,
    weighed,
)
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.inputs import ModelInputs
from lightning_d9d.modules.loss import InternalLosses
from lightning_d9d.pipeline.runner import LossFn, PipelineRunner
from lightning_d9d.plans import split_batch


class HoldsMesh(Protocol):
    """A strategy that holds the degrees and the mesh (both d9d strategies, through ``MeshTopology``)."""

    @property
    def parallel_dims(self) -> ParallelDims: ...


@dataclasses.dataclass(frozen=True)
class LossContext:
    """How a strategy runs one forward's loss.

    Attributes:
        strategy: whose ``parallel_dims`` the loss runs on (read once the inputs are checked).
        runner: the pipeline runner under pp > 1, else None.
        accumulate: micro-steps per optimizer step (the Trainer's ``accumulate_grad_batches``; 1 elsewhere).
        tokens: token-weighted accumulation's window where this micro-step weighs by its tokens, else None.
        internal_losses: whether the step scales the losses a model adds in its forward (the Trainer's strategy
            does; a Fabric loop scales them itself).
        forward_context: what the model's forward runs in without a pipeline (Fabric's precision context).
    """

    strategy: HoldsMesh
    runner: PipelineRunner | None = None
    accumulate: int = 1
    tokens: TokenWindow | None = None
    internal_losses: bool = False
    forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


def compute_loss(
    model: nn.Module, inputs: ModelInputs, target: torch.Tensor, loss_fn: LossFn, context: LossContext
) -> torch.Tensor:
    """``loss_fn(model(*inputs), target)`` (``model(**inputs)`` for a dict) on this rank's part of the batch,
    weighed by its share of the global batch's counted items; under pp through the schedule (see the module
    docstring and ``D9DStrategy.model_loss``)."""
    runner = context.runner
    if runner is not None:
        inputs = pipeline_inputs(inputs)
    dims = context.strategy.parallel_dims
    split = context_split(dims)
    if split is not None:
        inputs, target = split_batch(split, inputs, target)
    pipelined = runner is not None
    count = global_count(dims, loss_fn, target, needed=context.tokens is not None, pipelined=pipelined)
    scale = item_scale(dims, count, pipelined=pipelined)
    # this micro-step's share of the step's gradient (under pp handed to the schedule)
    grad_factor: torch.Tensor | None = None
    router_share = 1.0
    if context.tokens is not None and count is not None:
        grad_factor, is_reference = context.tokens.add(count)
        if not is_reference and isinstance(model, InternalLosses):
            router_share = float(grad_factor)  # the router losses' scale is a float: one host read
        if runner is not None:  # the schedule runs backward inside this call
            grad_factor = context.tokens.commit()
    if context.internal_losses:
        microbatches = runner.config.microbatches if runner is not None else 1
        scale_internal_losses(model, router_share, accumulate=context.accumulate, microbatches=microbatches)
    if runner is None:
        with context.forward_context():
            return forward_loss(model, inputs, target, loss_fn, tensor_parallel=dims.tp_enabled, scale=scale)
    return _pipelined_loss(
        runner,
        model,
        inputs,
        target,
        loss_fn,
        accumulate=context.accumulate,
        scale=scale,
        grad_factor=grad_factor,
        tensor_parallel=dims.tp_enabled,
    )


# ------------------------------------------------------------------------------ the hand-off to the runner
def pipeline_inputs(inputs: ModelInputs) -> dict[str, torch.Tensor]:
    """The inputs under pp > 1 as keywords: the token ids (the first stage's positional input) and a packed
    batch's ``position_ids`` (every stage's keyword input). A tuple ``(ids,)`` or ``(ids, position_ids)`` (our
    models' order) or a dict with those names; anything else is refused, naming what was given."""
    if isinstance(inputs, Mapping):
        named = dict(inputs)
    elif 1 <= len(inputs) <= 2:
        named = dict(zip(("input_ids", "position_ids"), inputs, strict=False))
    else:
        named = {}
    if "input_ids" not in named or not set(named) <= {"input_ids", "position_ids"}:
        given = sorted(inputs) if isinstance(inputs, Mapping) else f"{len(inputs)} positional inputs"
        raise ValueError(
            f"model_loss under pp > 1 takes the token ids and, for packed documents, their position_ids: "
            f"(input_ids,), (input_ids, position_ids) or a dict of those names; got {given}"
        )
    return named


def stage_inputs(named: ModelInputs) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """The first stage's positional token ids and every stage's keyword inputs, from :func:`pipeline_inputs`'
    dict (cut by cp, still a dict)."""
    assert isinstance(named, Mapping)  # compute_loss named them under pp
    return (named["input_ids"],), {name: value for name, value in named.items() if name != "input_ids"}


def _pipelined_loss(
    runner: PipelineRunner,
    model: nn.Module,
    inputs: ModelInputs,
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    accumulate: int,
    scale: torch.Tensor | None,
    grad_factor: torch.Tensor | None,
    tensor_parallel: bool,
) -> torch.Tensor:
    """The batch's loss through the schedule: in training forward and backward (the loss comes back detached,
    the gradients computed), else forward only, weighed like a rank's loss without a pipeline."""
    if model is not runner.model:
        raise ValueError("model_loss(model, ...) under pp > 1 must be given the pipelined model")
    # the same decision as without a pipeline: then the last stage computes the loss without logits
    fused_index = fused_ignore_index(model, loss_fn, tensor_parallel=tensor_parallel)
    ids, stage_kwargs = stage_inputs(inputs)
    if torch.is_grad_enabled():
        return runner.train_step(
            ids,
            target,
            loss_fn,
            accumulate=accumulate,
            item_scale=scale,
            grad_factor=grad_factor,
            fused_ignore_index=fused_index,
            stage_kwargs=stage_kwargs,
        )
    loss = runner.eval_step(ids, target, loss_fn, fused_ignore_index=fused_index, stage_kwargs=stage_kwargs)
    return weighed(loss, loss_fn, target, scale)
