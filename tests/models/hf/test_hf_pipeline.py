"""A transformers causal LM cut into pipeline stages by its own config's pp plan, inside Lightning's loop: every
family, 1F1B and Interleaved1F1B (with validation), with accumulation and clipping, composed with tp and FSDP
(Qwen3-MoE with tp and ep), against one process running the unmodified model (losses, gradient norms before
clipping, parameters after every step; fp32, 1e-5). All runs share one launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_parity_run import BATCHES, assert_matches_reference

MIXED_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def pp_run(family: str, schedule: str, *, devices: int = 2, **dims: Any) -> dict[str, Any]:
    interleaved = schedule == "Interleaved1F1B"
    return {
        "family": family,
        "layers": 4 if interleaved else 2,
        "devices": devices,
        "dims": {"pp": 2, "pipeline_schedule": schedule, "microbatches": 4 if interleaved else 2, **dims},
        "batches": BATCHES,
    }


RUNS: dict[str, dict[str, Any]] = {
    "qwen3_1F1B": {**pp_run("qwen3", "1F1B"), "validate": True},
    # sliding-window layers between full ones: each stage must look its layers' types up by global index
    "qwen3_Interleaved1F1B_mixed_layers": {
        **pp_run("qwen3", "Interleaved1F1B"),
        "validate": True,
        "model": {"layer_types": MIXED_LAYERS, "sliding_window": 3, "use_sliding_window": True},
    },
    "llama_1F1B_accumulate2_clip": {**pp_run("llama", "1F1B"), "accumulate": 2, "clip": 4.0},
    "llama_Interleaved1F1B": {**pp_run("llama", "Interleaved1F1B"), "validate": True},
    "mistral_1F1B_sliding_window": {**pp_run("mistral", "1F1B"), "model": {"sliding_window": 3}},
    # its forward soft-caps the logits only where final_logit_softcapping is set: None (its default) is a plain head
    "gemma3_1F1B": {
        **pp_run("gemma3", "1F1B"),
        "model": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
    },
    # the last stage repeats what the forward does to the head's output: a soft cap (small enough to bite),
    # a division, a multiplication (loss.logit_steps)
    "gemma2_1F1B_soft_cap": {
        **pp_run("gemma2", "1F1B"),
        "model": {"final_logit_softcapping": 2.0, "sliding_window": 3},
    },
    "granite_1F1B_logits_scaling": {
        **pp_run("granite", "1F1B"),
        "model": {
            "logits_scaling": 4.0,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.25,
        },
    },
    "cohere_1F1B_logit_scale": pp_run("cohere", "1F1B"),  # its default logit_scale: 0.0625
    # the embedding on stage 0 tied to the head on stage 1 (Gemma's default): each rank initialises its copy by
    # its own name on meta, then takes stage 0's value; the copies' gradients summed, the norm counting one
    "gemma_1F1B_tied_meta_accumulate2_clip": {
        **pp_run("gemma", "1F1B"),
        "model": {"tie_word_embeddings": True},
        "meta": True,
        "accumulate": 2,
        "clip": 2.7,  # the reference's norms: 2.68, 2.67, 2.74
    },
    "qwen3_moe_1F1B": {**pp_run("qwen3_moe", "1F1B"), "validate": True},
    # packed rows: every stage of every microbatch gets the positions, transformers builds each stage's mask
    "qwen3_1F1B_packed": {**pp_run("qwen3", "1F1B"), "validate": True, "packed": True},
    "qwen3_moe_Interleaved1F1B_accumulate2": {**pp_run("qwen3_moe", "Interleaved1F1B"), "accumulate": 2},
    # built on meta in configure_model: each rank initialises its stages as one process would the whole model
    "qwen3_pp2_tp2_meta": {**pp_run("qwen3", "1F1B", devices=4, tp=2), "meta": True},
    "llama_pp2_tp2_Interleaved1F1B": {
        **pp_run("llama", "Interleaved1F1B", devices=4, tp=2),
        "validate": True,
    },
    "qwen3_pp2_dp2_tp2": pp_run("qwen3", "1F1B", devices=8, dp_shard=2, tp=2),
    # each stage's MoE blocks route its sequence shards, ep carved from the tp ranks
    "qwen3_moe_pp2_tp2_ep2": pp_run("qwen3_moe", "1F1B", devices=4, tp=2, ep=2),
    # no pp or tp plan in its config: the adapter's own (models/hf/family_plans.py), the head's tp plan carried
    # into the last stage
    "stablelm_pp2_tp2": pp_run("stablelm", "1F1B", devices=4, tp=2),
}


SAVES, RESUMES, SAVE_EVERY = "qwen3_1F1B", "qwen3_pp1_resumed", 2


def prepare_runs(out: Path) -> dict[str, dict[str, Any]]:
    """``RUNS``, its qwen3_1F1B saving training checkpoints mid-epoch, then one process resuming from one."""
    checkpoints = out / "pp2_checkpoints"
    resumed = {"family": "qwen3", "layers": 2, "devices": 1, "dims": {}, "batches": BATCHES}
    return {
        **RUNS,
        SAVES: {**RUNS[SAVES], "ckpt_dir": str(checkpoints), "save_every": SAVE_EVERY},
        RESUMES: {**resumed, "resume_from": str(checkpoints / f"step={2 * SAVE_EVERY}.ckpt")},
    }


@pytest.mark.slow
def test_a_pp2_checkpoint_resumes_mid_epoch_on_one_process(parity_results: dict[str, dict[str, Any]]) -> None:
    """pp=2's training checkpoint of step 4 (of 6, one epoch) resumes at pp=1 and continues as pp=2 did: the
    stages' parameters under their transformers names, the optimizer state and the loader's position."""
    saved, resumed = parity_results[f"{__name__}.{SAVES}"], parity_results[f"{__name__}.{RESUMES}"]
    step = 2 * SAVE_EVERY
    assert len(resumed["losses"]) == BATCHES - step  # the rest of the epoch, not a new one
    assert max(abs(a - b) for a, b in zip(resumed["losses"], saved["losses"][step:], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(resumed["norms"], saved["norms"][step:], strict=True)) <= 1e-5
    assert set(resumed["params"]) == set(saved["params"])
    for name, param in saved["params"].items():
        assert float((resumed["params"][name] - param).abs().max()) <= 1e-5, name
        assert not torch.equal(resumed["start"][name], resumed["params"][name]), (
            name
        )  # the resumed steps moved it


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_pipeline_matches_one_process(parity_results: dict[str, dict[str, Any]], name: str) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    # rank 0 holds the first stage(s): half the layers, or under Interleaved1F1B stages 0 and 2
    assert got["layers_here"] == ([0, 2] if run["layers"] == 4 else [0])
    assert ("tp" in got["meshes"]) == ("tp" in run["dims"])
    assert_matches_reference(run, got)
