"""Gradient-norm clipping for parameters that live on several device meshes.

``torch.nn.utils.clip_grad_norm_`` stacks all per-parameter norms into one tensor, which fails as soon as
DTensor gradients sit on different meshes (for example TP layers on (dp, tp) and the head on (dp)). Here the
norm is computed per (mesh, placements) group, each group's norm is made a plain tensor (that is the
collective over the group's mesh), and the groups are combined; ``extra_groups`` (the pipeline group) then
adds up the norms of parameters that other ranks hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_d9d.pipeline.tied import is_tied_copy

_GroupKey = tuple[object, ...]


def _group_key(param: Tensor) -> _GroupKey:
    if isinstance(param, DTensor):
        return ("dtensor", param.device_mesh, tuple(param.placements), param.device.type)
    return ("local", param.device.type)


def group_parameters_by_mesh(parameters: Iterable[Tensor]) -> list[list[Tensor]]:
    """Parameters that have a gradient, grouped so that each group can share one foreach kernel."""
    groups: dict[_GroupKey, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_group_key(param), []).append(param)
    return list(groups.values())


def _local_norm(norm: Tensor) -> Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _group_norm(grads: list[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
    """The norm of one group's gradients, in fp32 at least: bf16 gradients (``MasterWeightAdamW``'s) would
    otherwise give a bf16 norm, 2**-9 off, and clip by it."""
    if all(g.dtype in (torch.float32, torch.float64) for g in grads):
        return torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def total_grad_norm(
    groups: Sequence[Sequence[Tensor]],
    norm_type: float = 2.0,
    *,
    extra_groups: Sequence[dist.ProcessGroup | None] = (),
    foreach: bool | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """The ``norm_type``-norm of all gradients of all ``groups`` (and of the same groups on ``extra_groups``).

    A rank without gradients (a frozen pipeline stage) still joins the ``extra_groups`` reductions with a zero
    on ``device``: its peers would otherwise wait for it forever.
    """
    norm_type = float(norm_type)
    # A weight tied across pipeline ranks counts once: its other copies hold the same (summed) gradient.
    counted = [[p.grad for p in group if p.grad is not None and not is_tied_copy(p)] for group in groups]
    norms = [_local_norm(_group_norm(grads, norm_type, foreach)) for grads in counted if grads]
    if norms:
        device = norms[0].device
    stacked = torch.stack([norm.to(device=device, dtype=torch.float32) for norm in norms]) if norms else None
    if stacked is None:
        stacked = torch.zeros(1, dtype=torch.float32, device=device)
    if norm_type == float("inf"):
        total = stacked.max()
        for group in extra_groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powered = (stacked**norm_type).sum()
    for group in extra_groups:
        dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    extra_groups: Sequence[dist.ProcessGroup | None] = (),
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    scale_in_step: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """Scale all gradients so that their joint norm is at most ``max_norm``; returns the norm before clipping.

    ``scale_in_step`` (``MasterWeightAdamW.scale_gradients``) takes the coefficient instead: the optimizer applies
    it in fp32 in its step, rather than a pass here rewriting bf16 gradients."""
    parameters = list(parameters)
    groups = group_parameters_by_mesh(parameters)
    # Where a zero norm must be made (no gradients here): the parameters' device, which the collective needs.
    device = parameters[0].device if parameters else None
    total = total_grad_norm(groups, norm_type, extra_groups=extra_groups, foreach=foreach, device=device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is not finite: {total.item()}"
        )
    if scale_in_step is not None:
        scale_in_step(clip_coefficient(total, max_norm))
        return total
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """What clipping to ``max_norm`` multiplies the gradients by: torch's ``clip_grads_with_norm_`` formula."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float, *, foreach: bool | None = None) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, one foreach call per mesh group."""
    for group in group_parameters_by_mesh(parameters):
        torch.nn.utils.clip_grad_value_(group, clip_value, foreach=foreach)
