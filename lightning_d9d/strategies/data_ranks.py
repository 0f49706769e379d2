"""The ranks that hold different tokens, and what Lightning reduces over them: ``self.log(..., sync_dist=True)``
and torchmetrics. They are the ``loss`` view (data replicas times the cp ranks that each hold part of every
sequence), never tp or pp peers: those hold the same batch, so a sum over the world would count it ``pp * tp``
times."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.mesh import ParallelDims


def data_rank_group(dims: ParallelDims | None) -> dist.ProcessGroup | None:
    """The ``loss`` view's group; None (the world) before the mesh exists."""
    if dims is None or dims.mesh is None:
        return None
    return dims.mesh_for("loss").get_group()


def reduce_over_data_ranks(
    tensor: torch.Tensor | Any, dims: ParallelDims | None, group: Any | None, reduce_op: Any | None
) -> torch.Tensor | Any:
    """All-reduce ``tensor`` over ``group`` (by default the data ranks); ``"mean"`` sums, then divides. No barrier
    before it (Lightning puts one there; on NCCL it blocks the host every step, and an all-reduce needs none)."""
    if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
        return tensor
    if group is None:
        group = data_rank_group(dims)
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    op = dist.ReduceOp.SUM if mean else (getattr(dist.ReduceOp, name.upper()) if name else reduce_op)
    dist.all_reduce(tensor, op=op, group=group)
    if mean:
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
    return tensor


def sync_metrics_over_data_ranks(module: nn.Module, dims: ParallelDims | None) -> None:
    """torchmetrics syncs over the world unless told otherwise: point the metrics of ``module`` without a group
    of their own at the data ranks."""
    from torchmetrics import Metric

    group = data_rank_group(dims)
    if group is None or dims is None or dist.get_world_size(group) == dims.world_size:
        return  # those ranks are the world: nothing to change
    for metric in module.modules():
        if isinstance(metric, Metric) and metric.process_group is None:
            metric.process_group = group
