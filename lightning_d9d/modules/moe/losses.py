"""Router losses: the switch / GShard auxiliary load-balancing loss and the ST-MoE router z-loss, unweighted,
plus :func:`attach_loss`, which adds a loss's gradient to a block's backward without another output.

``load_balancing_loss`` is ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``T`` tokens that chose
expert ``e`` among their top-k (so ``sum_e f_e = k``) and ``P_e`` the mean router probability of ``e``. Only
``P`` carries a gradient. For one layer and no padding mask this is transformers' ``load_balancing_loss_func``
(which, over several layers, averages ``f`` and ``P`` over the layers before multiplying them, where we sum
per-layer losses). Perfectly balanced routing gives ``k``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.modules.moe.router import Routing


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``probs [T, E]`` (fp32 router probabilities), ``tokens_per_expert [E]`` (top-k slots per expert) ->
    scalar; see the module docstring."""
    num_tokens, num_experts = probs.shape
    fraction = tokens_per_expert.to(torch.float32) / max(num_tokens, 1)
    mean_probability = probs.float().mean(dim=0) if num_tokens else probs.float().sum(dim=0)
    return num_experts * torch.sum(fraction * mean_probability)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` in fp32 (ST-MoE): keeps router logits small."""
    if logits.shape[0] == 0:
        return logits.float().sum()
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def router_loss(routing: Routing, *, aux_loss_coef: float, z_loss_coef: float) -> torch.Tensor:
    """``aux_loss_coef * load_balancing_loss + z_loss_coef * router_z_loss`` (a term with coefficient 0 is
    not computed)."""
    loss = routing.probs.new_zeros(())
    if aux_loss_coef:
        loss = loss + aux_loss_coef * load_balancing_loss(routing.probs, routing.tokens_per_expert)
    if z_loss_coef:
        loss = loss + z_loss_coef * router_z_loss(routing.logits)
    return loss


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_dtype = loss.dtype
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        loss_grad = torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, loss_grad, None


def attach_loss(output: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``output`` unchanged; its backward also sends gradient ``scale`` into the scalar ``loss``.

    Backward through the result is then the backward of ``(the user's loss) + scale * loss``, without
    ``loss`` travelling to the user: the way an auxiliary loss reaches every pipeline stage's backward exactly
    once per micro-batch. ``scale`` must match how the user's loss is scaled (e.g. ``1 / micro-batches``)."""
    result: torch.Tensor = _AttachLoss.apply(output, loss, scale)
    return result
