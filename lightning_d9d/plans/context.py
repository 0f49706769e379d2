"""Context parallelism: every sequence split over the cp ranks with causal load balancing, exact attention.

cp rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` of ``2cp`` (see
:class:`~lightning_d9d.modules.context_attention.LoadBalancedSplit`). Everything but attention is position-wise,
so it runs on the local tokens unchanged; attention sees the whole sequence's keys and values through
:class:`~lightning_d9d.modules.context_attention.AllGatherAttention`, the portable exact path (CPU/gloo and
GPUs), or torch's ring kernels on CUDA (:class:`~lightning_d9d.modules.context_attention.TorchRingAttention`;
packed batches, whose document mask it cannot take, on the all-gather path), or, asked for by name
(``"heads"``), head-parallel: the heads split over the cp ranks around each block's own attention over the whole
sequence (:class:`~lightning_d9d.modules.head_parallel_attention.HeadParallelAttention`; where cp does not divide a
rank's query heads, the heads split over ``gcd(heads, cp)`` ranks and the keys gathered over the rest:
:mod:`~lightning_d9d.modules.hybrid_attention`). The cp ranks of one data replica
get the same batch from the sampler; :func:`split_batch` cuts it (inputs and labels alike) before the model. The
loss of each rank is its local tokens' mean, weighed by the strategy over the ``loss`` view (which includes cp)
into the global token mean; FSDP shards over ``dp_shard * cp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.modules.attention import Attention
from lightning_d9d.modules.context_attention import LoadBalancedSplit, context_attention
from lightning_d9d.modules.hybrid_attention import head_group_size, hybrid_head_parallel
from lightning_d9d.modules.inputs import ModelInputs


@runtime_checkable
class ContextSplitAware(Protocol):
    """A module that derives its RoPE positions from the split it runs under (``None``: the whole sequence),
    and gathers a packed batch's positions over the cp group (``context_group``) into the document mask of its
    queries against every key, once per forward
    (:func:`~lightning_d9d.modules.context_attention.gather_positions`); with ``context_heads`` (head-parallel
    attention) the whole sequence's queries: each rank attends every position for some heads."""

    context_split: LoadBalancedSplit | None
    context_group: dist.ProcessGroup | None
    context_heads: bool


def parallelize_context(
    module: nn.Module, cp_mesh: DeviceMesh, attention: str = "auto", *, tp: int = 1
) -> LoadBalancedSplit:
    """Switch every :class:`~lightning_d9d.modules.Attention` in ``module`` to context-parallel attention over the
    1-D ``cp_mesh`` and hand the split and the cp group to every :class:`ContextSplitAware` submodule (for its
    positions and a packed batch's document mask), in place.

    ``attention`` names the path (:func:`~lightning_d9d.modules.context_attention.context_attention`):
    ``"auto"`` (torch's ring kernels on CUDA, all-gather elsewhere), ``"all_gather"``, ``"torch_ring"`` or
    ``"heads"`` (head-parallel where cp divides each tp rank's query heads, ``num_heads / tp``; else the heads
    split over ``gcd(num_heads / tp, cp)`` ranks and the keys gathered over the others, or, where that is 1, the
    all-gather path). Returns the split, which says what :func:`split_batch` cuts each batch into.
    """
    if cp_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_context needs the 1-D cp mesh, got {cp_mesh.ndim}-D {cp_mesh.mesh_dim_names}"
        )
    attentions = [submodule for submodule in module.modules() if isinstance(submodule, Attention)]
    if not attentions:
        raise ValueError(
            f"parallelize_context: {type(module).__name__} has no lightning_d9d Attention module to split the "
            "sequence for; build its attention from lightning_d9d.modules.Attention, or use cp=1"
        )
    cp = cp_mesh.size()
    split = LoadBalancedSplit(cp, cp_mesh.get_local_rank())
    heads = attention == "heads"
    group = head_group_size(math.gcd(*(submodule.num_heads // tp for submodule in attentions)), cp)
    if heads and group < cp:  # each rank's query rows of the mask, as on the all-gather path
        heads = False
        attention = "all_gather" if group == 1 else attention
    attend = (
        hybrid_head_parallel(split, cp_mesh, group)
        if attention == "heads" and not heads
        else context_attention(split, cp_mesh, attention)
    )
    for submodule in attentions:
        submodule.context = attend
    for aware in module.modules():
        if isinstance(aware, ContextSplitAware):
            aware.context_split = split
            aware.context_group = cp_mesh.get_group()
            aware.context_heads = heads
    return split


def split_batch(
    split: LoadBalancedSplit, inputs: ModelInputs, target: torch.Tensor
) -> tuple[ModelInputs, torch.Tensor]:
    """This cp rank's part of a batch: ``target`` (``[B, T, ...]``) and every input tensor (of a tuple or a dict)
    whose first two dims are the target's ``[B, T]`` (token ids, explicit position ids) cut along the sequence dim
    alike; other inputs pass unchanged. A ``T`` not divisible by ``2 * cp`` raises ``ValueError`` with the
    numbers."""
    if target.dim() < 2:
        raise ValueError(
            f"context parallelism splits the target along its sequence dim (1), but it is {target.dim()}-D "
            f"{tuple(target.shape)}; pass [batch, sequence] labels, or use cp=1"
        )
    split.check(target.shape[1])
    batch_and_sequence = target.shape[:2]

    def cut(value: torch.Tensor) -> torch.Tensor:
        same = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == batch_and_sequence
        return split.split(value, dim=1) if same else value

    if isinstance(inputs, Mapping):
        return {name: cut(value) for name, value in inputs.items()}, split.split(target, dim=1)
    return tuple(cut(value) for value in inputs), split.split(target, dim=1)
