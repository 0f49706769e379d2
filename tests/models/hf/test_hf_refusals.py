"""What the transformers adapter refuses, from the degrees and the model's config alone: no process group exists
in these tests, so each refusal comes before any collective. And which modules get the adapter's plan."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import lightning_d9d.models.hf as hf
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import check_hf_model, hf_plan_for, parallelize_hf
from lightning_d9d.plans import ParallelOptions


def tiny(family: str = "qwen3", **overrides: object) -> nn.Module:
    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    values = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        **overrides,
    }
    return model_class(config_class(**values))


def test_tp_without_a_plan_in_the_config_is_refused() -> None:
    model = tiny()
    model.config.base_model_tp_plan = None
    with pytest.raises(
        ValueError,
        match=r"^Qwen3ForCausalLM: tp=2 needs a tensor-parallel plan, but its config \(Qwen3Config\) has no "
        r"base_model_tp_plan",
    ):
        parallelize_hf(model, ParallelDims(tp=2), ParallelOptions())


@pytest.mark.parametrize(
    ("family", "tp", "overrides", "message"),
    [
        ("qwen3", 4, {}, r"^Qwen3ForCausalLM: tp \(4\) must divide num_key_value_heads \(2\)"),
        ("llama", 3, {}, r"^LlamaForCausalLM: tp \(3\) must divide num_attention_heads \(4\)"),
        (
            "llama",
            2,
            {"intermediate_size": 129},
            r"^LlamaForCausalLM: tp \(2\) must divide intermediate_size \(129\)",
        ),
        ("qwen3", 2, {"vocab_size": 127}, r"^Qwen3ForCausalLM: tp \(2\) must divide vocab_size \(127\)"),
    ],
)
def test_sizes_tp_does_not_divide_are_refused(
    family: str, tp: int, overrides: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_hf_model(tiny(family, **overrides), ParallelDims(tp=tp))


@pytest.mark.parametrize("degree", ["pp", "ep"])  # cp: test_hf_context_parallel.py
def test_other_degrees_are_not_yet(degree: str) -> None:
    with pytest.raises(
        NotImplementedError,
        match=rf"^the transformers adapter for LlamaForCausalLM: {degree}=2 is not implemented yet .*; "
        rf"use {degree}=1, or wait for issue 24",
    ):
        parallelize_hf(tiny("llama"), ParallelDims(**{degree: 2}), ParallelOptions())


@pytest.mark.parametrize(
    "style",
    ["packed_colwise", "moe_tp_experts", "colwise_gather_output"],  # the last: for the head only
)
def test_a_style_not_translated_yet_is_refused(style: str) -> None:
    model = tiny()
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": style}
    with pytest.raises(
        NotImplementedError,
        match=rf"^Qwen3ForCausalLM: tp=2: the tp plan's style '{style}' \(for model\.layers\.0\.mlp\.gate_proj\) "
        r"is not translated yet \(issue 24\)",
    ):
        check_hf_model(model, ParallelDims(tp=2))


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 8.0


def test_an_embedding_with_a_forward_of_its_own_is_refused() -> None:
    model = tiny("llama")
    model.model.embed_tokens = ScaledEmbedding(128, 64)
    with pytest.raises(
        NotImplementedError,
        match=r"^LlamaForCausalLM: tp=2: the input embedding ScaledEmbedding has a forward of its own",
    ):
        check_hf_model(model, ParallelDims(tp=2))


def test_a_module_among_split_projections_the_plan_does_not_name_is_refused() -> None:
    model = tiny()
    plan = model.config.base_model_tp_plan
    model.config.base_model_tp_plan = {k: v for k, v in plan.items() if not k.endswith("_norm")}
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3ForCausalLM: tp=2: model\.layers\.0\.self_attn\.q_norm \(Qwen3RMSNorm\) sits among split "
        r"projections but the config's tp plan does not name it",
    ):
        check_hf_model(model, ParallelDims(tp=2))


def test_only_transformers_models_get_the_adapter() -> None:
    assert hf_plan_for(tiny()) is not None
    assert hf_plan_for(nn.Linear(2, 2)) is None


def test_the_adapter_imports_no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its sources import no transformers, and without transformers imported no module is taken for one."""
    sources = Path(hf.__file__).parent.glob("*.py")
    imported = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for path in sources
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert "transformers" not in imported
    model = tiny()
    for name in ("transformers", "transformers.modeling_utils"):  # what the check looks up
        monkeypatch.delitem(sys.modules, name)
    assert hf_plan_for(model) is None
    assert "transformers" not in sys.modules
