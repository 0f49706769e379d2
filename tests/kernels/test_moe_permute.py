"""Token permutation: rows grouped by expert in a stable order, and the weighted way back equals a loop."""

from __future__ import annotations

import torch

from lightning_d9d.kernels import count_tokens_per_expert, permute_tokens, unpermute_tokens


def test_permute_groups_slots_by_expert_stably() -> None:
    hidden = torch.arange(4.0).unsqueeze(1).repeat(1, 2)  # token t is the row [t, t]
    indices = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 1]])
    grouped, permutation = permute_tokens(hidden, indices)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 2, 3; expert 2: tokens 0, 1, 2 (token order kept)
    assert grouped[:, 0].tolist() == [0, 1, 3, 2, 3, 0, 1, 2]
    assert count_tokens_per_expert(indices, 4).tolist() == [3, 2, 3, 0]
    assert permutation.order.tolist() == [1, 2, 6, 5, 7, 0, 3, 4]  # slots t * k + j


def test_unpermute_is_the_weighted_sum_over_each_tokens_choices() -> None:
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size, top_k, experts = 7, 5, 3, 6
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    scale = torch.randn(experts, hidden_size, generator=generator)  # a per-expert "expert": x * scale[e]

    grouped, permutation = permute_tokens(hidden, indices)
    sorted_experts = indices.reshape(-1)[permutation.order]
    out = unpermute_tokens(grouped * scale[sorted_experts], permutation, weights)

    expected = torch.zeros(tokens, hidden_size)
    for token in range(tokens):
        for choice in range(top_k):
            expert = int(indices[token, choice])
            expected[token] += weights[token, choice] * hidden[token] * scale[expert]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
