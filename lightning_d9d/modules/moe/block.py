"""The MoE feed-forward block: router -> dispatcher -> grouped experts -> combine (+ shared experts).

Attribute names follow transformers' ``Qwen3MoeSparseMoeBlock`` (``gate`` is the router, ``experts``), so a
Qwen3-MoE decoder layer's ``mlp`` maps onto it name for name; the expert weights differ only in layout (see
:mod:`lightning_d9d.modules.moe.experts`). With ``shared_intermediate_size`` a plain SwiGLU runs on every token
beside the routed experts and is added to their output.

Router losses: with a nonzero ``aux_loss_coef`` / ``z_loss_coef``, a training-mode forward computes
``router_loss`` and attaches its gradient to the block's output (:func:`~lightning_d9d.modules.moe.losses.
attach_loss`, scaled by ``aux_loss_scale``), so no extra output has to cross pipeline stages and each
micro-batch's backward adds it once. The detached value is kept in ``last_router_loss`` for logging. Under
context parallelism ``sequence_group`` (the cp group, set by the model's plan) makes the load-balancing loss
count the tokens per expert of the whole sequences (:func:`~lightning_d9d.modules.moe.balancing.
mean_tokens_per_expert`); under tensor parallelism it is the cp x tp group and ``router_loss_share`` 1/tp (each
tp rank routes its own positions: :mod:`lightning_d9d.plans.routing`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.modules.mlp import SwiGLU
from lightning_d9d.modules.moe.balancing import mean_tokens_per_expert
from lightning_d9d.modules.moe.dispatch import LocalDispatcher, TokenDispatcher
from lightning_d9d.modules.moe.experts import GroupedExperts
from lightning_d9d.modules.moe.losses import attach_loss, router_loss
from lightning_d9d.modules.moe.router import TopKRouter


class MoE(nn.Module):
    """``[..., hidden]`` -> ``[..., hidden]``: each token's top-k experts, weighted by the router, summed."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        normalize_top_k: bool = False,
        selection_bias: bool = False,
        shared_intermediate_size: int | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        dispatcher: TokenDispatcher | None = None,
        gemm_backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if aux_loss_coef < 0 or z_loss_coef < 0:
            raise ValueError(
                f"aux_loss_coef ({aux_loss_coef}) and z_loss_coef ({z_loss_coef}) must be >= 0 (0 turns one off)"
            )
        self.hidden_size = hidden_size
        self.gate = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            normalize_top_k=normalize_top_k,
            selection_bias=selection_bias,
            device=device,
        )
        self.experts = GroupedExperts(
            num_experts, hidden_size, intermediate_size, gemm_backend=gemm_backend, device=device
        )
        self.shared_experts = (
            SwiGLU(hidden_size, shared_intermediate_size, device=device) if shared_intermediate_size else None
        )
        self.dispatcher: TokenDispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.aux_loss_scale = 1.0
        # This rank's share of the router losses' gradient: 1/tp when each tp rank routes its own sequence shard
        # and the block's gradients are summed over tp (plans.route_on_sequence_shards), else 1.
        self.router_loss_share = 1.0
        self.last_router_loss: torch.Tensor | None = None
        # The ranks holding the other parts of this rank's sequences (cp), whose tokens the load-balancing
        # loss counts too; None: this rank's tokens are whole sequences.
        self.sequence_group: dist.ProcessGroup | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, self.hidden_size)
        routing = self.gate(tokens)
        dispatched = self.dispatcher.dispatch(tokens, routing)
        expert_output = self.experts(dispatched.tokens, dispatched.tokens_per_expert, dispatched.row_weights)
        output = self.dispatcher.combine(expert_output, dispatched)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        if self.training and (self.aux_loss_coef or self.z_loss_coef):
            if self.sequence_group is not None and self.aux_loss_coef:
                counts = mean_tokens_per_expert(routing.tokens_per_expert, self.sequence_group)
                routing = dataclasses.replace(routing, tokens_per_expert=counts)
            loss = router_loss(routing, aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef)
            self.last_router_loss = loss.detach()
            output = attach_loss(output, loss, self.aux_loss_scale * self.router_loss_share)
        return output.reshape(shape)
