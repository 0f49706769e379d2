"""The router equals transformers' Qwen3-MoE router; the selection bias chooses without weighting; the load
is counted in training forwards only."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from lightning_d9d.modules.moe import TopKRouter


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_transformers(normalize: bool, dtype: torch.dtype) -> None:
    config = Qwen3MoeConfig(hidden_size=24, num_experts=7, num_experts_per_tok=3, norm_topk_prob=normalize)
    reference = Qwen3MoeTopKRouter(config).to(dtype)
    router = TopKRouter(24, 7, 3, normalize_top_k=normalize).to(dtype)
    with torch.no_grad():
        reference.weight.normal_(generator=torch.Generator().manual_seed(0))
        router.weight.copy_(reference.weight)
    hidden = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits, weights, indices = reference(hidden)
    routing = router(hidden)
    assert torch.equal(routing.expert_indices, indices)
    assert torch.equal(routing.expert_weights, weights) and routing.expert_weights.dtype == dtype
    assert torch.equal(routing.logits, logits)
    assert routing.probs.dtype == torch.float32
    assert routing.tokens_per_expert.tolist() == torch.bincount(indices.flatten(), minlength=7).tolist()


def test_selection_bias_chooses_but_does_not_weigh() -> None:
    router = TopKRouter(2, 4, 2, selection_bias=True)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [-1.0, 0.0]]))
    hidden = torch.tensor([[2.0, 1.0]])  # logits [2, 1, 0, -2]: experts 0 and 1 without a bias
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -2.0]), dim=0)
    assert router(hidden).expert_indices.tolist() == [[0, 1]]
    assert router.expert_bias is not None
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # lifts expert 3 above expert 1 for choosing
    routing = router(hidden)
    assert routing.expert_indices.tolist() == [[3, 0]]
    torch.testing.assert_close(routing.expert_weights, probs[[3, 0]].unsqueeze(0))  # unbiased probabilities
    assert "expert_bias" in router.state_dict() and "expert_load" not in router.state_dict()


def test_load_is_counted_in_training_forwards_only() -> None:
    router = TopKRouter(5, 6, 2)
    hidden = torch.randn(9, 5, generator=torch.Generator().manual_seed(2))
    router.eval()
    counts = router(hidden).tokens_per_expert
    assert int(router.expert_load.sum()) == 0
    router.train()
    router(hidden)
    router(hidden)
    assert torch.equal(router.expert_load, 2 * counts) and int(counts.sum()) == 18


def test_top_k_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"top_k \(5\) must be between 1 and num_experts \(4\)"):
        TopKRouter(8, 4, 5)
