"""Mixture-of-Experts blocks: router, losses, load balancing, grouped experts, token dispatch, the MoE block."""

from lightning_d9d.modules.moe.all_to_all import AllToAllDispatcher
from lightning_d9d.modules.moe.balancing import (
    LoadCountingRouter,
    counts_expert_load,
    paused_load_counting,
    routers_in,
    update_expert_bias,
)
from lightning_d9d.modules.moe.block import MoE
from lightning_d9d.modules.moe.choose import expert_parallel_dispatcher
from lightning_d9d.modules.moe.deepep import DeepEPDispatcher, deep_ep_available
from lightning_d9d.modules.moe.dispatch import Dispatched, LocalDispatcher, TokenDispatcher
from lightning_d9d.modules.moe.expert_tensor import ExpertTensorParallelDispatcher
from lightning_d9d.modules.moe.experts import GroupedExperts, GroupedGemmExperts
from lightning_d9d.modules.moe.losses import attach_loss, load_balancing_loss, router_loss, router_z_loss
from lightning_d9d.modules.moe.router import Routing, TopKRouter

__all__ = [
    "AllToAllDispatcher",
    "DeepEPDispatcher",
    "Dispatched",
    "ExpertTensorParallelDispatcher",
    "GroupedExperts",
    "GroupedGemmExperts",
    "LoadCountingRouter",
    "LocalDispatcher",
    "MoE",
    "Routing",
    "TokenDispatcher",
    "TopKRouter",
    "attach_loss",
    "counts_expert_load",
    "deep_ep_available",
    "expert_parallel_dispatcher",
    "load_balancing_loss",
    "paused_load_counting",
    "router_loss",
    "router_z_loss",
    "routers_in",
    "update_expert_bias",
]
