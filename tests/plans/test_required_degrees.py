"""One check refuses the degrees a plan lacks; its message names who refuses, the degree, its value and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.plans import (
    DATA_PARALLEL,
    IMPLEMENTED,
    ParallelOptions,
    parallelize_default,
    require_degrees,
)


def degrees(**values: int) -> dict[str, Any]:
    return values


def test_message_names_owner_degree_value_and_fix() -> None:
    with pytest.raises(NotImplementedError) as raised:
        require_degrees(ParallelDims(tp=4), supported=DATA_PARALLEL, owner="MyPlan")
    assert str(raised.value) == "MyPlan: tp=4 is not implemented yet (tensor parallelism); use tp=1"


def test_alternative_is_offered_for_its_degree_only() -> None:
    alternatives = {"pp": "split it into stages"}
    with pytest.raises(NotImplementedError, match=r"MyPlan: pp=2 .*; use pp=1, or split it into stages$"):
        require_degrees(ParallelDims(pp=2), supported=(), owner="MyPlan", alternatives=alternatives)
    with pytest.raises(NotImplementedError, match=r"MyPlan: cp=2 .*; use cp=1$"):
        require_degrees(ParallelDims(cp=2), supported=(), owner="MyPlan", alternatives=alternatives)


def test_supported_and_unresolved_degrees_pass() -> None:
    require_degrees(ParallelDims(pp=2, dp_replicate=2, dp_shard=-1), supported=IMPLEMENTED, owner="x")
    require_degrees(ParallelDims(tp=2, ep=2), supported=("tp", "ep"), owner="x")


def test_unknown_degree_name_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match=r"unknown degree names \['dp'\]"):
        require_degrees(ParallelDims(), supported=("dp",), owner="x")


@pytest.mark.parametrize("degree", ["pp", "tp", "cp", "ep"])
def test_default_plan_does_data_parallelism_only(degree: str) -> None:
    # Refused before anything is touched, so no process group is needed.
    module = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        NotImplementedError,
        match=rf"the default plan for Sequential .*: {degree}=2 is not implemented yet .*; use {degree}=1, "
        r"or give Sequential a parallelize\(dims, options\) method",
    ):
        parallelize_default(module, ParallelDims(**degrees(**{degree: 2})), ParallelOptions())


@pytest.mark.parametrize("degree", ["ep"])  # its cp and tp plans are the whole model's
def test_qwen3_stage_refuses_degrees_without_plans(degree: str) -> None:
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    stage = model.pipeline_stage([0, 1], first=True, last=True)
    with pytest.raises(NotImplementedError, match=f"Qwen3Stage: {degree}=2 is not implemented yet"):
        stage.parallelize(ParallelDims(**degrees(pp=2, **{degree: 2})), ParallelOptions())


def moe_model_and_stage() -> list[tuple[str, Any]]:
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())
    return [
        ("Qwen3MoeForCausalLM", model),
        ("Qwen3MoeStage", model.pipeline_stage([0, 1, 2], first=True, last=True)),
    ]


def test_qwen3_moe_accepts_tp_and_refuses_one_that_does_not_divide_the_heads() -> None:
    for owner, plan in moe_model_and_stage():
        pp = 2 if owner == "Qwen3MoeStage" else 1
        # past the degree guard and the size check, the plan asks for the tp mesh (these dims have none)
        with pytest.raises(RuntimeError, match=r"mesh_for\(\) needs a mesh"):
            plan.parallelize(ParallelDims(pp=pp, tp=2).resolve(2 * pp), ParallelOptions())
        # the tiny model has 4 query heads: tp=3 is refused by name before any mesh or collective
        with pytest.raises(ValueError, match=rf"^{owner}: tp \(3\) must divide num_attention_heads \(4\)"):
            plan.parallelize(ParallelDims(pp=pp, tp=3).resolve(3 * pp), ParallelOptions())


def test_qwen3_moe_accepts_cp_alone_and_with_ep() -> None:
    # past the degree guard, the plan asks for the cp mesh (these dims have none): cp is not refused
    for owner, plan in moe_model_and_stage():
        pp = 2 if owner == "Qwen3MoeStage" else 1
        for ep in (1, 2):
            dims = ParallelDims(pp=pp, cp=2, ep=ep).resolve(2 * pp)
            with pytest.raises(RuntimeError, match=r"mesh_for\(\) needs a mesh"):
                plan.parallelize(dims, ParallelOptions())


def test_qwen3_model_points_pipelines_to_its_stages() -> None:
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    with pytest.raises(
        NotImplementedError, match=r"use pp=1, or call Qwen3Stage.parallelize on each pipeline"
    ):
        model.parallelize(ParallelDims(pp=2), ParallelOptions())
