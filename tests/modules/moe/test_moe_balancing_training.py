"""The auxiliary-loss-free bias update balances the experts of a model in training.

The tiny Qwen3-MoE (8 experts, top-2) cut to its two sparse layers, the load-balancing loss off, 200 AdamW
steps on one process, :func:`update_expert_bias` after each step as ``ExpertLoadBalancing`` calls it; once with
rate 1e-2 and once with rate 0. The coefficient of variation of the expert load summed over the last 20 steps (summed, so
that sampling noise of a small batch does not hide the imbalance), averaged over the sparse layers, must drop.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from pretrain_qwen3 import SyntheticCorpus

from lightning_d9d.callbacks.moe import load_statistics
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.moe import routers_in, update_expert_bias

STEPS, LAST, BATCH, SEQ = 200, 20, 4, 16


def load_cv_after_training(rate: float) -> tuple[float, Qwen3MoeForCausalLM]:
    torch.manual_seed(0)
    # two sparse layers, no dense one: the cheapest model that still has routers at two depths
    config = Qwen3MoeConfig.tiny(
        num_hidden_layers=2, mlp_only_layers=[], output_router_logits=False, router_selection_bias=True
    )
    model = Qwen3MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = SyntheticCorpus(config.vocab_size, SEQ, BATCH * STEPS)
    routers = routers_in(model)
    window = torch.zeros(len(routers), config.num_experts, dtype=torch.int64)
    for step in range(STEPS):
        items = [corpus[step * BATCH + i] for i in range(BATCH)]
        ids = torch.stack([item["input_ids"] for item in items])
        labels = torch.stack([item["labels"] for item in items])
        causal_lm_loss(model(ids), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        loads = update_expert_bias(routers, rate)
        if step >= STEPS - LAST:
            window += loads
    cv = sum(load_statistics(load)["cv"] for load in window) / len(routers)
    return cv, model


def test_bias_update_lowers_the_load_imbalance() -> None:
    torch.set_num_threads(1)
    without, _ = load_cv_after_training(0.0)
    with_update, model = load_cv_after_training(1e-2)
    print(
        f"expert load CV over the last {LAST} of {STEPS} steps: without bias update {without:.3f}, with {with_update:.3f}"
    )
    assert with_update < 0.5 * without, (without, with_update)
    assert all(
        router.expert_bias is not None and router.expert_bias.abs().max() > 0 for router in routers_in(model)
    )
