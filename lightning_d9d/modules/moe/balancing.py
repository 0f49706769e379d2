"""Load counted across ranks: the auxiliary-loss-free bias update, and the load-balancing loss's token counts
under context parallelism.

Auxiliary-loss-free load balancing (DeepSeek-V3): after each optimizer step, move each router's selection bias
by ``rate * sign(mean load - load)`` per expert, from the load counted over the accumulation window. The load
must be the whole step's, so it is summed over every micro-step (each router counts into its ``expert_load``
buffer in training forwards) and over the ranks that saw different tokens with the same router replica (one
all-reduce over ``group``: the callback passes the strategy's ``routing`` view, the data-parallel x
context-parallel x tensor-parallel ranks, since under tp each rank routes its own positions; ep ranks included).
Every rank then applies the same update, so the replicas stay equal. Call it after ``optimizer.step()`` on
every rank (``lightning_d9d.callbacks.ExpertLoadBalancing`` does, once per optimizer step).

Under context parallelism a rank holds part of each sequence; the load-balancing loss's per-expert token
fractions must be those of the whole sequences (:func:`mean_tokens_per_expert`), so that the cp ranks' losses,
averaged like their gradients, equal one process's loss on the whole sequences.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeGuard

import torch
import torch.distributed as dist
from torch import nn


class LoadCountingRouter(Protocol):
    """A router that counts its experts' load for the bias update: our :class:`~.router.TopKRouter`, or a
    ``transformers`` router given the counting forward (:func:`lightning_d9d.models.hf.routing.count_router_load`).

    ``expert_load [E]`` (int64) holds the slots each expert received in training forwards since the last update
    (none while ``count_load`` is off); ``expert_bias [E]`` (fp32) is the selection bias, ``None`` where the
    router only counts."""

    num_experts: int
    expert_load: torch.Tensor
    expert_bias: torch.Tensor | None
    count_load: bool


def counts_expert_load(module: object) -> TypeGuard[LoadCountingRouter]:
    """Whether ``module`` has :class:`LoadCountingRouter`'s members. Not ``isinstance`` against a runtime-checkable
    protocol: since Python 3.12 that looks attributes up with ``inspect.getattr_static``, which does not see an
    ``nn.Module``'s buffers (kept in ``_buffers``, served by ``Module.__getattr__``), so no router matched there:
    the selection biases were never moved and ``init_weights`` left the buffers as ``to_empty`` made them."""
    return all(hasattr(module, name) for name in LoadCountingRouter.__annotations__)


def routers_in(module: nn.Module) -> list[LoadCountingRouter]:
    """Every load-counting router in ``module`` (:class:`LoadCountingRouter`), in module order."""
    return [child for child in module.modules() if counts_expert_load(child)]


@torch.no_grad()
def update_expert_bias(
    routers: Sequence[LoadCountingRouter], rate: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum each router's ``expert_load`` over ``group`` (no communication when ``None``), update the
    ``expert_bias`` of routers that have one, reset every ``expert_load``, and return the summed loads
    ``[R, E]`` (int64; ``R`` routers, ``E`` experts each: one layout, so one all-reduce) for logging."""
    if not routers:
        return torch.zeros(0, 0, dtype=torch.int64)
    widths = {router.num_experts for router in routers}
    if len(widths) != 1:
        raise ValueError(f"update_expert_bias needs routers with one number of experts, got {sorted(widths)}")
    loads = torch.stack([router.expert_load for router in routers])
    if group is not None:
        dist.all_reduce(loads, op=dist.ReduceOp.SUM, group=group)
    for router, load in zip(routers, loads, strict=True):
        if router.expert_bias is not None:
            load_float = load.to(torch.float32)
            router.expert_bias.add_(rate * torch.sign(load_float.mean() - load_float))
        router.expert_load.zero_()
    return loads


@torch.no_grad()
def mean_tokens_per_expert(tokens_per_expert: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tokens_per_expert [E]`` averaged over the ranks of ``group`` (fp32, no gradient): divided by this rank's
    token count it is the fraction of the whole sequences' tokens per expert, since every cp rank holds the
    same number of tokens (:class:`~lightning_d9d.modules.context_attention.LoadBalancedSplit`). A collective:
    every rank of ``group`` calls it in the same forward."""
    total = tokens_per_expert.clone()  # summed as counted (int64: exact), the routing's own counts untouched
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.to(torch.float32) / dist.get_world_size(group)


@contextmanager
def paused_load_counting(module: nn.Module) -> Generator[None, None, None]:
    """Forwards of ``module`` inside this block count no expert load: for forwards that run the model without
    training on its tokens (torch's pipeline stages run one on placeholder tensors to infer shapes)."""
    routers = routers_in(module)
    for router in routers:
        router.count_load = False
    try:
        yield
    finally:
        for router in routers:
            router.count_load = True
