"""One forward's loss on the mesh, as the Trainer's and Fabric's strategies compute it without a pipeline.

- cp: each cp rank keeps its load-balanced part of every sequence (:func:`context_split`).
- A :class:`~lightning_d9d.modules.loss.CountedLoss` weighs each rank by its share of the items (tokens) of the
  global batch (:func:`global_count`, :func:`item_scale`), so that averaging over the data ranks gives the mean
  over all items, as one process would.
- tp: the logits stay sharded on the vocabulary and the cross-entropy runs on the shards (``loss_parallel``);
  a model of ours with ``causal_lm_loss`` fuses its head with the loss instead (no ``[tokens, vocab]`` logits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.causal_lm import fused_causal_lm_loss
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.inputs import ModelInputs, call_model, check_inputs
from lightning_d9d.modules.loss import CountedLoss
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.plans import local_loss, maybe_loss_parallel


def context_split(dims: ParallelDims | None) -> LoadBalancedSplit | None:
    """Which part of each sequence this rank holds under cp > 1 (the model's plan attends accordingly)."""
    if dims is None or not dims.cp_enabled:
        return None
    cp_mesh = dims.mesh_for("cp")
    return LoadBalancedSplit(cp_mesh.size(), cp_mesh.get_local_rank())


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


def forward_loss(
    model: nn.Module,
    inputs: ModelInputs,
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    tensor_parallel: bool,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """``loss_fn(model(*inputs), target)`` (``model(**inputs)`` for a dict) weighed by ``scale``: the head fused
    with the loss where the model offers it, else under ``loss_parallel`` when tp shards the logits."""
    check_inputs(model, inputs)  # before the fused path binds them to the forward's parameters
    fused = fused_causal_lm_loss(model, inputs, target, loss_fn, tensor_parallel=tensor_parallel)
    if fused is not None:  # the same loss without [tokens, vocab] logits
        return weighed(fused, loss_fn, target, scale)
    output = call_model(model, inputs)
    with maybe_loss_parallel(tensor_parallel):
        loss = local_loss(loss_fn(output, target))
    return weighed(loss, loss_fn, target, scale)
