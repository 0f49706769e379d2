"""A transformers causal LM cut into pipeline stages by its own config's pp plan, inside Lightning's loop: every
family, 1F1B and Interleaved1F1B (with validation), with accumulation and clipping, composed with tp and FSDP
(Qwen3-MoE with tp and ep), against one process running the unmodified model (losses, gradient norms before
clipping, parameters after every step; fp32, 1e-5). All runs share one launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
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
    "qwen3_moe_1F1B": {**pp_run("qwen3_moe", "1F1B"), "validate": True},
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
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_pipeline_matches_one_process(parity_results: dict[str, dict[str, Any]], name: str) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    # rank 0 holds the first stage(s): half the layers, or under Interleaved1F1B stages 0 and 2
    assert got["layers_here"] == ([0, 2] if run["layers"] == 4 else [0])
    assert ("tp" in got["meshes"]) == ("tp" in run["dims"])
    assert_matches_reference(run, got)
