"""A transformers Qwen3-MoE with its experts split over ``ep`` by its own config's ep plan (our dispatcher, the
model's own router), inside Lightning's loop, alone and with FSDP, HSDP, pipelines and context parallelism, with
an expert no token chooses, against one process running the unmodified model (losses, gradient norms before
clipping, parameters after every step; fp32, 1e-5). All runs share one launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hf_parity_run import assert_matches_reference


def ep_run(devices: int, **dims: Any) -> dict[str, Any]:
    # expert 3 of 4 chosen by no token: its rank holds an expert with no rows
    return {"family": "qwen3_moe", "layers": 2, "devices": devices, "dims": dims, "exclude_experts": [3]}


PIPELINE = {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2}
RUNS: dict[str, dict[str, Any]] = {
    "ep2": {**ep_run(2, ep=2), "validate": True},
    "ep2_accumulate2_clip": {**ep_run(2, ep=2), "accumulate": 2, "clip": 3.2},
    "dp_shard4_ep2": ep_run(4, dp_shard=4, ep=2),
    "dp_replicate2_dp_shard2_ep2": ep_run(4, dp_replicate=2, dp_shard=2, ep=2),
    "cp2_ep2": ep_run(2, cp=2, ep=2),
    "pp2_ep2": {**ep_run(4, ep=2, **PIPELINE), "validate": True},
    # the auxiliary-loss-free bias, its loads summed over the ranks routing different tokens (ep, data, tp)
    "ep2_selection_bias": {**ep_run(2, ep=2), "exclude_experts": [], "selection_bias": 0.02},
    "tp2_dp_shard2_selection_bias": {
        **ep_run(4, tp=2, dp_shard=2),
        "exclude_experts": [],
        "selection_bias": 0.02,
    },
    "pp2_selection_bias": {**ep_run(2, **PIPELINE), "exclude_experts": [], "selection_bias": 0.02},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_expert_parallel_matches_one_process(parity_results: dict[str, dict[str, Any]], name: str) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    assert ("ep" in got["meshes"]) == ("ep" in run["dims"])  # the experts were split over ep
    assert_matches_reference(run, got)


def test_the_selection_bias_changes_the_routing() -> None:
    """The bias runs above would prove nothing if the bias never changed a choice: the one-process reference
    with it trains otherwise than without it."""
    from tiny_hf import reference_run, tiny_causal_lm

    from lightning_d9d.models.hf import add_selection_bias

    plain = reference_run(tiny_causal_lm("qwen3_moe"), 6)
    biased_model = tiny_causal_lm("qwen3_moe")
    add_selection_bias(biased_model)
    biased = reference_run(biased_model, 6, bias_rate=0.02)
    assert plain["losses"][0] == biased["losses"][0]  # the bias starts at zero
    assert abs(plain["losses"][-1] - biased["losses"][-1]) > 1e-4
