"""The router losses under context parallelism: 2 gloo ranks, each holding half of every sequence, with the
cp group as ``MoE.sequence_group``, give (averaged like their gradients) the router gradient of one process
on the whole sequences; without the group each rank's load-balancing loss sees only its own tokens and the
gradient differs (the test of the test)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_d9d.modules.moe import MoE

HIDDEN, EXPERTS, TOP_K, FFN = 8, 6, 2, 12


def _block() -> MoE:
    torch.manual_seed(0)
    block = MoE(HIDDEN, EXPERTS, TOP_K, FFN, aux_loss_coef=0.5, z_loss_coef=0.1).train()
    with torch.no_grad():
        block.gate.weight.mul_(3)  # uneven routing: the local and the whole-sequence fractions differ
    return block


def _tokens() -> torch.Tensor:
    return torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(1))


def _router_gradient(block: MoE, tokens: torch.Tensor) -> torch.Tensor:
    # the output's mean: a token mean like the language-model loss, so the ranks' gradients average to the whole
    block(tokens).mean().backward()
    assert block.gate.weight.grad is not None
    return block.gate.weight.grad


def _on_rank(with_group: bool) -> torch.Tensor:
    block = _block()
    if with_group:
        block.sequence_group = dist.group.WORLD
    half = _tokens().chunk(2, dim=1)[dist.get_rank()]  # any equal split: the block is position-wise
    gradient = _router_gradient(block, half)
    dist.all_reduce(gradient)
    return gradient / dist.get_world_size()


def test_cp_ranks_give_the_router_gradient_of_whole_sequences() -> None:
    expected = _router_gradient(_block(), _tokens())
    for gradient in run_distributed(_on_rank, 2, True):
        torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7)
    local_only = run_distributed(_on_rank, 2, False)[0]
    assert (local_only - expected).abs().max() > 1e-4
