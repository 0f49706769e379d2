"""Router losses against a hand-computed example, a brute-force loop, and transformers' aux loss; the
attached loss's gradient equals adding the loss to the objective."""

from __future__ import annotations

import math

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from lightning_d9d.kernels import count_tokens_per_expert
from lightning_d9d.modules.moe import attach_loss, load_balancing_loss, router_z_loss


def brute_force_load_balancing(probs: list[list[float]], indices: list[list[int]]) -> float:
    tokens, experts = len(probs), len(probs[0])
    total = 0.0
    for expert in range(experts):
        chosen = sum(1 for token in range(tokens) if expert in indices[token])
        mean_probability = sum(probs[token][expert] for token in range(tokens)) / tokens
        total += (chosen / tokens) * mean_probability
    return experts * total


def test_load_balancing_loss_by_hand() -> None:
    # 2 tokens, 2 experts, top-1: both choose expert 0. f = (1, 0), P = (0.7, 0.3) -> 2 * 0.7 = 1.4
    probs = torch.tensor([[0.6, 0.4], [0.8, 0.2]])
    loss = load_balancing_loss(probs, torch.tensor([2, 0]))
    assert math.isclose(float(loss), 1.4, rel_tol=1e-6)
    # Balanced top-1 routing with uniform probabilities gives 1 (k in general).
    assert math.isclose(float(load_balancing_loss(torch.full((2, 2), 0.5), torch.tensor([1, 1]))), 1.0)


def test_load_balancing_loss_equals_brute_force_and_transformers() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(13, 6, generator=generator)
    probs = torch.softmax(logits, dim=-1)
    indices = torch.topk(probs, 2, dim=-1).indices
    loss = load_balancing_loss(probs, count_tokens_per_expert(indices, 6))
    expected = brute_force_load_balancing(probs.tolist(), indices.tolist())
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    hf = load_balancing_loss_func((logits,), num_experts=6, top_k=2)
    assert math.isclose(float(loss), float(hf), rel_tol=1e-6)
    # The gradient flows through the probabilities only.
    probs.requires_grad_(True)
    (grad,) = torch.autograd.grad(load_balancing_loss(probs, count_tokens_per_expert(indices, 6)), probs)
    counts = count_tokens_per_expert(indices, 6).float()
    torch.testing.assert_close(grad, (6 * counts / 13 / 13).expand(13, 6))


def test_router_z_loss_by_hand_and_brute_force() -> None:
    assert math.isclose(float(router_z_loss(torch.zeros(3, 2))), math.log(2) ** 2, rel_tol=1e-6)
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 5
    assert math.isclose(float(router_z_loss(logits)), expected, rel_tol=1e-6)
    assert router_z_loss(logits.bfloat16()).dtype == torch.float32


def test_attached_loss_gradient_is_added_once_with_its_scale() -> None:
    weight = torch.randn(3, 3, generator=torch.Generator().manual_seed(7), requires_grad=True)
    hidden = torch.randn(4, 3, generator=torch.Generator().manual_seed(8))

    def terms() -> tuple[torch.Tensor, torch.Tensor]:
        output = hidden @ weight
        return output, (weight**2).sum()

    output, aux = terms()
    attached = attach_loss(output, aux, scale=0.25)
    assert torch.equal(attached, output)
    (grad,) = torch.autograd.grad(attached.sin().sum(), weight)
    output, aux = terms()
    (expected,) = torch.autograd.grad(output.sin().sum() + 0.25 * aux, weight)
    torch.testing.assert_close(grad, expected)
