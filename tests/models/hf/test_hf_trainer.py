"""``Trainer(strategy=D9DStrategy(tp=2))`` on a LightningModule holding a transformers causal LM, with a tied head,
gradient accumulation and clipping that bites on some steps, alone and under FSDP; Qwen3-MoE's blocks routing each
rank's sequence shard (with an expert no token chooses), with ep carved from the tp ranks and with FSDP; against
one process running the unmodified model (losses, gradient norms before clipping, parameters; fp32, 1e-5). The strategy picks the
adapter's plan itself (``D9DStrategy._parallelize`` asks ``hf_plan_for``): the parameters live on the tp mesh.
The runs share the folder's launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hf_parity_run import assert_matches_reference

TIED = {"tie_word_embeddings": True}
# expert 3 of 4 chosen by no token
MOE: dict[str, Any] = {"family": "qwen3_moe", "layers": 2, "exclude_experts": [3]}
CLIP_MOE = 3.1
RUNS: dict[str, dict[str, Any]] = {
    "qwen3_tp2_tied_accumulate2_clip": {
        "family": "qwen3", "layers": 2, "devices": 2, "dims": {"tp": 2}, "model": TIED, "accumulate": 2,
        "clip": 4.2, "validate": True,
    },
    "llama_tp2_dp_shard2": {"family": "llama", "layers": 2, "devices": 4, "dims": {"tp": 2, "dp_shard": 2}},
    "qwen3_moe_tp2_accumulate2_clip": {
        **MOE, "devices": 2, "dims": {"tp": 2}, "accumulate": 2, "clip": CLIP_MOE, "validate": True,
    },
    "qwen3_moe_tp2_ep2": {**MOE, "devices": 2, "dims": {"tp": 2, "ep": 2}},
    "qwen3_moe_tp2_dp_shard2_ep2": {**MOE, "devices": 4, "dims": {"tp": 2, "dp_shard": 2, "ep": 2}},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_tp_matches_one_process(parity_results: dict[str, dict[str, Any]], name: str) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    assert "tp" in got["meshes"]
    assert_matches_reference(run, got)
