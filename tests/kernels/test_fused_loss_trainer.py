"""``Trainer(strategy="d9d")`` with the fused LM head + cross-entropy (forced on CPU, where it is off by default)
equals the single-process loop on logits: FSDP over 2 processes with padded labels (token-weighted ranks),
gradient accumulation, a head tied to the embedding, context parallelism, pipeline parallelism (the last stage
handed the labels: 1F1B with padding and accumulation, an interleaved schedule, Qwen3-MoE with router losses);
under tensor parallelism it steps aside for the logits path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_trainer_parity import BASE, assert_matches_reference, run_trainer

CASES = {
    "fused_fsdp2_padded_accumulate": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "accumulate": 2,
        "pad": True,
        "lr": 3e-4,
        "validate": True,
    },
    "fused_fsdp2_tied": {"devices": 2, "dp": 2, "max_steps": 3, "model": {"tie_word_embeddings": True}},
    # each cp rank's loss over its part of the sequences, weighed like a data-parallel rank's
    "fused_cp2": {"devices": 2, "dp": 1, "max_steps": 3, "dims": {"cp": 2}},
    # tp > 1: the fused path steps aside for logits + loss parallel (logged)
    "fused_tp2_falls_back": {"devices": 2, "dp": 1, "max_steps": 3, "dims": {"tp": 2}},
    # pp = 2: the last stage returns each microbatch's loss, weighed by its tokens; validation through it too
    "fused_pp2_1F1B_padded_accumulate": {
        "devices": 2,
        "dp": 1,
        "max_steps": 3,
        "accumulate": 2,
        "pad": True,
        "validate": True,
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    # two stages per rank: the labels reach both of rank 1's stages, only the last one reads them
    "fused_pp2_interleaved": {
        "devices": 2,
        "dp": 1,
        "max_steps": 3,
        "validate": True,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "pipeline_schedule": "Interleaved1F1B", "microbatches": 4},
    },
    # Qwen3-MoE stages: the router losses (aux and z) reach the gradient through the fused loss's backward
    "fused_pp2_moe": {
        "devices": 2,
        "dp": 1,
        "max_steps": 3,
        "moe": {"num_hidden_layers": 4, "router_z_loss_coef": 1e-3},
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


CONFIGS = {name: {**BASE, **case} for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case in one 2-process launch, fused forced on (the launched ranks inherit the variable)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")
        tmp = tmp_path_factory.mktemp("fused_loss")
        return run_trainer(list(CONFIGS.values()), tmp, "fused_loss", names=list(CONFIGS), fork=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_loss_matches_the_logits_loop(name: str, results: dict) -> None:
    config = CONFIGS[name]
    assert_matches_reference(results[name], config)
    # the fused path ran on every training batch (on every microbatch under pp; counted on the busiest rank),
    # except where tp makes it step aside
    calls = results[name]["fused_loss_calls"]
    if name.endswith("falls_back"):
        assert calls == 0
    else:
        microbatches = config.get("dims", {}).get("microbatches", 1)
        assert calls >= config["max_steps"] * config.get("accumulate", 1) * microbatches
