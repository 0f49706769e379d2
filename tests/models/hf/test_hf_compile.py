"""``D9DStrategy(compile=True, activation_checkpointing="selective")`` on a transformers causal LM, one case per
family, each composed with a degree: the decoder layers checkpointed (matmuls and attention kept, the rest
recomputed), then compiled per layer, then sharded, in torchtitan's order; against one process running the
unmodified model eagerly (losses, gradient norms before clipping, parameters; fp32, 1e-5). Dynamo traces each
layer and AOTAutograd splits its forward and backward with the recompute inside, as under Inductor, but the
graphs run on ``aot_eager`` (Inductor's code generation is minutes on a 2-core machine and is exercised by the
GPU benchmarks). The runs share the folder's launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hf_parity_run import assert_matches_reference

COMPILED = {"compile": True, "activation_checkpointing": "selective"}
RUNS: dict[str, dict[str, Any]] = {
    "llama_dp_shard2": {"family": "llama", "layers": 2, "devices": 2, "dims": {**COMPILED, "dp_shard": 2}},
    "qwen3_tp2": {"family": "qwen3", "layers": 2, "devices": 2, "dims": {**COMPILED, "tp": 2}},
    # the experts' FSDP unit under ep breaks the layer's graph around it
    "qwen3_moe_ep2": {
        "family": "qwen3_moe", "layers": 2, "devices": 2, "dims": {**COMPILED, "ep": 2}, "exclude_experts": [3],
    },
}  # fmt: skip
for run in RUNS.values():
    run["compile_backend"] = "aot_eager"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_compiled_with_selective_recompute_matches_one_process(
    parity_results: dict[str, dict[str, Any]], name: str
) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    assert got["compiled_layers"] == run["layers"]  # per decoder layer
    assert got["checkpointed_layers"] == run["layers"]
    assert_matches_reference(run, got)
