"""One forward's loss without a pipeline: the model on this rank's part of the batch, its loss fused with the head
or computed on the logits, vocabulary-parallel where tp shards them, weighed by the rank's share of the tokens.

- cp: each cp rank keeps its load-balanced part of every sequence (:func:`context_split`).
- tp: the logits stay sharded on the vocabulary and the cross-entropy runs on the shards (torch's
  ``loss_parallel``, :func:`vocab_parallel`, whose backward needs it too); a model that declares its head fuses
  it with the loss instead where :mod:`lightning_d9d.loss.head` says so (no ``[tokens, vocab]`` logits).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from lightning_d9d.loss.head import fused_causal_lm_loss
from lightning_d9d.loss.weights import weighed
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.inputs import ModelInputs, call_model, check_inputs
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.plans import local_loss, maybe_loss_parallel


def context_split(dims: ParallelDims | None) -> LoadBalancedSplit | None:
    """Which part of each sequence this rank holds under cp > 1 (the model's plan attends accordingly)."""
    if dims is None or not dims.cp_enabled:
        return None
    cp_mesh = dims.mesh_for("cp")
    return LoadBalancedSplit(cp_mesh.size(), cp_mesh.get_local_rank())


def vocab_parallel(dims: ParallelDims | None) -> AbstractContextManager[None]:
    """Under tp the logits stay sharded on the vocabulary dim: the cross-entropy (and its backward, which the
    strategies' ``backward`` runs under this too) runs on the shards through torch's ``loss_parallel``, never
    gathering ``[tokens, vocab]``."""
    return maybe_loss_parallel(dims is not None and dims.tp_enabled)


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
