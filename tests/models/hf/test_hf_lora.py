"""LoRA on a ``transformers`` model under the adapter's plans, on two and four gloo ranks, against the one-rank run
of the same adapted model (fp32): dp_shard=2, tp=2 (adapters split with their layers), cp=2, pp=2 (1F1B), ep=2 on
Qwen3-MoE (attention adapted, experts split over ep; and with per-expert adapters, ``LoRA(experts=True)``, split
over ep with their experts, and whole on each rank under tp=2 and pp=2) and tp=2 x dp_shard=2. The worker and the band are the layout runs'
(``layout_runs.train_layout``, ``test_hf_layout_runs.FP32_BAND``); the frozen weights must come out bit for bit as
they went in, and only the adapters move. Experts in a layout the adapters cannot run are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from layout_runs import Layout, differences, start_parameters, train_layout
from test_hf_layout_runs import CPU, FP32_BAND
from tiny_hf import tiny_causal_lm
from torch import nn

from lightning_d9d.plans.lora import LoRA, adapted_layers, apply_lora

LORA = LoRA(rank=4, alpha=8.0)
ATTENTION = LoRA(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
EXPERTS = LoRA(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"), experts=True)
LAYOUTS = {
    "dp_shard2": Layout("qwen3", 2, {"dp_shard": 2}, lora=LORA),
    "tp2": Layout("qwen3", 2, {"tp": 2}, lora=LORA),
    "cp2": Layout("qwen3", 2, {"cp": 2}, context_attention="all_gather", lora=LORA),
    "pp2": Layout("qwen3", 2, {"pp": 2}, lora=LORA),
    "ep2_moe": Layout("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}, lora=ATTENTION),
    "ep2_moe_experts": Layout("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}, lora=EXPERTS),
    "tp2_moe_experts": Layout("qwen3_moe", 2, {"tp": 2}, lora=EXPERTS),  # experts whole a tp rank, tp-summed
    "pp2_moe_experts": Layout("qwen3_moe", 2, {"pp": 2}, lora=EXPERTS),
    "tp2_dp_shard2": Layout("qwen3", 4, {"tp": 2, "dp_shard": 2}, lora=LORA),
}
_one_rank: dict[str, dict] = {}


def one_rank_run(layout: Layout) -> dict:
    if repr(layout) not in _one_rank:
        (_one_rank[repr(layout)],) = run_distributed(train_layout, 1, layout, CPU, "fp32", timeout=120)
    return _one_rank[repr(layout)]


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lora_on_a_transformers_model_trains_as_one_rank(name: str) -> None:
    layout = LAYOUTS[name]
    got = run_distributed(train_layout, layout.world, layout, CPU, "fp32", timeout=120)[0]
    expected = one_rank_run(layout.one_rank())
    start = start_parameters(layout, CPU)
    errors = differences(got, expected, start)
    assert errors["steps"] == CPU.steps and errors["learnt"] > 1e-3
    for key, band in FP32_BAND.items():
        assert errors[key] <= band, (key, errors)
    adapters = [n for n in start if _adapter(n)]
    assert adapters and all(got["params"][n].abs().max() > 0 for n in adapters if ".lora_B." in n)
    for n, value in start.items():
        if not _adapter(n):
            assert got["params"][n].equal(value), f"frozen {n} changed"


def test_experts_in_another_layout_are_refused_by_name() -> None:
    """An experts module the adapters' forward cannot run (here a bias beside the stacked weights) takes none."""
    model = tiny_causal_lm("qwen3_moe")
    experts = model.get_submodule("model.layers.1.mlp.experts")
    experts.register_parameter("gate_up_proj_bias", nn.Parameter(torch.zeros(experts.gate_up_proj.shape[:2])))
    with pytest.raises(
        ValueError,
        match=r"LoRA\(experts=True\): Qwen3MoeForCausalLM's model.layers.1.mlp.experts \(Qwen3MoeExperts\) holds "
        r"\['down_proj', 'gate_up_proj', 'gate_up_proj_bias'\].*; its experts take no adapters: use experts=False",
    ):
        apply_lora(model, EXPERTS, seed=0)
    assert not adapted_layers(model)
