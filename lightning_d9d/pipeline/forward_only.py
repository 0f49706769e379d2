"""A forward-only pass through the pipeline (validation, prediction), for every stage placement.

torch's ``schedule.eval()`` does not work for the V-shaped schedules (ZBVZeroBubble, DualPipeV), so forward
runs here stage after stage on the whole batch: the owner of stage ``s`` receives its input from the owner
of ``s-1`` (or keeps it, when it owns both) and sends its output on. Shapes are sent ahead of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def _send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], device=tensor.device)
    dist.send(torch.tensor([header.numel()], device=tensor.device), dst=dst, group=group)
    dist.send(header, dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src, group=group)
    header = torch.empty(int(length), dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty([int(size) for size in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor


def pipeline_forward_loss(
    local_stages: Mapping[int, nn.Module],
    stage_owner: Callable[[int], int],
    num_stages: int,
    group: dist.ProcessGroup,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    *,
    last_stage_kwargs: Mapping[str, Any] | None = None,
    stage_kwargs: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Run all stages on the batch and return the loss, the same fp32 scalar on every pipeline rank.

    ``stage_owner(s)`` is the group rank that holds stage ``s``; ``inputs`` matter on the owner of stage 0,
    ``target`` on the owner of the last stage, and so do ``last_stage_kwargs`` (its forward's keyword arguments:
    the labels of a stage that computes the loss itself). ``stage_kwargs`` reach every stage's forward (a packed
    batch's ``position_ids``).
    """
    my_rank = dist.get_rank(group)
    hidden: torch.Tensor | tuple[torch.Tensor, ...] = inputs
    loss = torch.zeros((), dtype=torch.float32, device=device)
    for stage in range(num_stages):
        owner = stage_owner(stage)
        if owner != my_rank:
            continue
        if stage > 0 and stage_owner(stage - 1) != my_rank:
            hidden = _recv(dist.get_global_rank(group, stage_owner(stage - 1)), group, device)
        args = hidden if isinstance(hidden, tuple) else (hidden,)
        last = stage == num_stages - 1
        keywords = {**(stage_kwargs or {}), **((last_stage_kwargs or {}) if last else {})}
        output = local_stages[stage](*args, **keywords)
        if last:
            if target is None:
                raise ValueError("the last pipeline stage needs the target")
            loss = loss_fn(output, target).detach().float().reshape(())
        elif stage_owner(stage + 1) != my_rank:
            _send(output, dist.get_global_rank(group, stage_owner(stage + 1)), group)
        else:
            hidden = output
    dist.broadcast(loss, src=dist.get_global_rank(group, stage_owner(num_stages - 1)), group=group)
    return loss
