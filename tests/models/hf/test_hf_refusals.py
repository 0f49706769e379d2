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
from lightning_d9d.models.hf import (
    check_hf_model,
    hf_pipeline_for,
    hf_plan_for,
    hf_tensor_plan,
    parallelize_hf,
)
from lightning_d9d.models.hf.config_plans import config_tp_plan
from lightning_d9d.models.hf.embedding import NO_SCALE, EmbeddingScale, embedding_scale
from lightning_d9d.models.hf.loss import plain_head
from lightning_d9d.models.hf.pipeline import embedding_steps
from lightning_d9d.pipeline import StageLayout, check_pipeline_config
from lightning_d9d.pipeline.checks import check_pipeline_model
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.strategies.d9d import PIPELINE_VIEWS


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


def tiny_moe(**overrides: object) -> nn.Module:
    values = {
        "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, **overrides,
    }  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**values))


def test_ep_on_a_dense_model_is_refused() -> None:  # cp: test_hf_context_parallel.py
    with pytest.raises(
        ValueError,
        match=r"^LlamaForCausalLM: ep=2 needs an expert-parallel plan, but its config \(LlamaConfig\) has no "
        r"base_model_ep_plan \(a dense model has no experts to split\); use ep=1",
    ):
        check_hf_model(tiny("llama"), ParallelDims(ep=2))


def test_ep_that_does_not_divide_the_experts_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Qwen3MoeForCausalLM: ep=3: model\.layers\.0\.mlp\.experts \(Qwen3MoeExperts\): ep \(3\) must "
        r"divide the number of experts \(4\)",
    ):
        check_hf_model(tiny_moe(), ParallelDims(ep=3))


def test_experts_in_another_layout_are_refused() -> None:
    model = tiny_moe()
    experts = model.model.layers[0].mlp.experts
    experts.down_proj_bias = nn.Parameter(torch.zeros(4, 64))  # a family with expert biases
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3MoeForCausalLM: ep=2: model\.layers\.0\.mlp\.experts \(Qwen3MoeExperts\) holds "
        r"\['down_proj', 'down_proj_bias', 'gate_up_proj'\]; the adapter takes only transformers' stacked experts",
    ):
        check_hf_model(model, ParallelDims(ep=2))


def test_tp_with_router_logits_is_refused() -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3MoeForCausalLM: tp=2 with output_router_logits=True: each tp rank routes its own sequence "
        r"shard, so the load-balancing loss would count that shard's tokens only",
    ):
        check_hf_model(tiny_moe(output_router_logits=True), ParallelDims(tp=2))


def test_a_moe_model_without_sequence_parallelism_is_refused() -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3MoeForCausalLM: its MoE blocks run on each tp rank's sequence shard: sequence_parallel=False "
        r"is not supported for an MoE model",
    ):
        hf_tensor_plan(tiny_moe(), sequence_parallel=False)


def test_tp_on_a_moe_model_passes_the_checks() -> None:  # its parity: test_hf_trainer.py
    check_hf_model(tiny_moe(), ParallelDims(tp=2))


def test_an_ep_plan_naming_no_module_is_refused() -> None:
    model = tiny_moe()
    model.config.base_model_ep_plan = {"blocks.*.moe": "ep_dispatch_experts"}
    with pytest.raises(
        ValueError, match=r"^Qwen3MoeForCausalLM: ep=2: its config's base_model_ep_plan names no"
    ):
        check_hf_model(model, ParallelDims(ep=2))


def test_a_whole_model_plan_under_pp_names_the_pipeline() -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"^the transformers adapter for LlamaForCausalLM: pp=2 is not implemented yet .*; use pp=1, or "
        r"let D9DStrategy\(pp=...\) cut the model into stages",
    ):
        parallelize_hf(tiny("llama"), ParallelDims(pp=2), ParallelOptions())


def test_pp_without_a_pp_plan_is_refused() -> None:
    model = tiny()
    model.config.base_model_pp_plan = None
    with pytest.raises(
        ValueError,
        match=r"^Qwen3ForCausalLM: pp > 1 needs a pipeline plan, but base_model_pp_plan is missing "
        r"\(Qwen3Config\); use pp=1",
    ):
        hf_pipeline_for(model)


def test_pp_with_logits_the_last_stage_would_not_compute_is_refused() -> None:
    model = tiny()
    model.config.final_logit_softcapping = (
        30.0  # a soft-capping family's field (Gemma 2), which Qwen3 never reads
    )
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3ForCausalLM: pp > 1: its logits are not lm_head\(last hidden states\) followed by steps "
        r"the last stage can repeat \(its config sets final_logit_softcapping=30\.0: .*\); use pp=1$",
    ):
        hf_pipeline_for(model)


class OffsetQwen3(transformers.Qwen3ForCausalLM):
    """Adds a tensor to its logits: a step the last stage does not repeat."""

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:  # type: ignore[override]
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits + self.offset
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


def test_pp_with_a_step_on_the_logits_it_cannot_repeat_is_refused() -> None:
    model = OffsetQwen3(tiny().config)
    model.offset = torch.zeros(128)
    with pytest.raises(
        NotImplementedError,
        match=r"^OffsetQwen3: pp > 1: its logits are not lm_head\(last hidden states\) followed by steps the last "
        r"stage can repeat \(a head with a bias, a step on the logits: .*\); use pp=1$",
    ):
        hf_pipeline_for(model)


def test_gemma3_soft_caps_on_the_last_stage_only_where_its_config_caps_the_logits() -> None:
    """Gemma 3's forward soft-caps its logits under ``if self.config.final_logit_softcapping is not None``: with
    its default None the head is plain (no step), with a cap the last stage repeats the cap."""
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    assert config.final_logit_softcapping is None  # the default
    model = transformers.Gemma3ForCausalLM(config)
    pipeline = hf_pipeline_for(model)
    assert pipeline is not None and pipeline.logit_steps is not None and not pipeline.logit_steps.steps
    assert plain_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert plain_head(model) is None  # the fused loss keeps the logits path
    pipeline = hf_pipeline_for(model)
    assert pipeline is not None and pipeline.logit_steps is not None
    assert len(pipeline.logit_steps.steps) == 3  # / cap, tanh, * cap
    assert pipeline.logit_steps.fields == ("final_logit_softcapping",)


def test_pp_with_router_logits_is_refused() -> None:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3MoeForCausalLM: pp > 1 with output_router_logits=True: the load-balancing loss needs every "
        r"layer's router logits, which the pipeline stages do not return; set config.output_router_logits=False",
    ):
        hf_pipeline_for(transformers.Qwen3MoeForCausalLM(config))


def test_pp_with_tied_embeddings_is_refused_where_one_rank_holds_both_ends() -> None:
    owner = nn.Module()
    owner.model = tiny(num_hidden_layers=4, tie_word_embeddings=True)
    check_pipeline_model(owner, check_pipeline_config(2, "1F1B", 2, None), 2, StageLayout(), PIPELINE_VIEWS)
    config = check_pipeline_config(2, "ZBVZeroBubble", 4, None)
    with pytest.raises(
        ValueError,
        match=r"^pp=2: Qwen3ForCausalLM ties parameters \(model\.embed_tokens\.weight = lm_head\.weight\), "
        r"and the ZBVZeroBubble schedule puts the first and the last stage on one rank",
    ):
        check_pipeline_model(owner, config, 2, StageLayout(), PIPELINE_VIEWS)


@pytest.mark.parametrize(
    "style",
    # the last two: split by heads where a fused projection, a q/k/v or MLA's latent projection has them
    ["packed_colwise", "moe_tp_experts", "colwise_gather_output", "mla_kv_a_proj"],
)
def test_a_style_not_translated_yet_is_refused(style: str) -> None:
    model = tiny()
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": style}
    with pytest.raises(
        NotImplementedError,
        match=rf"^Qwen3ForCausalLM: tp=2: the tp plan's style '{style}' \(for model\.layers\.0\.mlp\.gate_proj\) "
        r"is not translated yet;",
    ):
        check_hf_model(model, ParallelDims(tp=2))


def test_stablelm_gets_the_adapters_plans_and_a_shipped_plan_wins() -> None:
    """StableLM's config ships no tp or pp plan and its class no head plans: the adapter's (family_plans) apply;
    a plan the config ships is taken instead."""
    config = transformers.StableLmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.StableLmForCausalLM(config)
    assert config.base_model_tp_plan is None and config.base_model_pp_plan is None
    plan = config_tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    check_hf_model(model, ParallelDims(tp=2))
    pipeline = hf_pipeline_for(model)
    assert pipeline is not None and list(pipeline.plan) == ["embed_tokens", "layers", "norm"]
    assert pipeline.head_name == "lm_head"
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "colwise"}
    assert set(config_tp_plan(model)) == {"model.layers.*.mlp.gate_proj", "lm_head"}


def test_stablelm_per_head_norms_are_refused_under_tp() -> None:
    """``qk_layernorm=True``: one LayerNorm per head (``q_layernorm.norms.<head>``), which the plan does not split:
    each rank would run the first heads' norms on its own heads."""
    config = transformers.StableLmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, qk_layernorm=True,
    )  # fmt: skip
    with pytest.raises(
        NotImplementedError,
        match=r"^StableLmForCausalLM: tp=2: model\.layers\.0\.self_attn\.q_layernorm\.norms\.0 \(LayerNorm\) sits "
        r"among split projections but the config's tp plan does not name it",
    ):
        check_hf_model(transformers.StableLmForCausalLM(config), ParallelDims(tp=2))


def test_a_lora_adapted_fused_projection_is_refused_under_tp() -> None:
    """Phi-3's fused ``qkv_proj`` is split by heads by cutting its gathered output (head_split.FusedColumns);
    LoRA's styles would shard the adapted layer as a plain column-parallel one."""
    from lightning_d9d.modules.lora import LoRALinear

    config = transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.Phi3ForCausalLM(config)
    check_hf_model(model, ParallelDims(tp=2))  # translated
    attention = model.model.layers[0].self_attn
    attention.qkv_proj = LoRALinear.from_linear(attention.qkv_proj, rank=4, alpha=8.0)
    with pytest.raises(
        NotImplementedError,
        match=r"^Phi3ForCausalLM: tp=2: the fused projection model\.layers\.0\.self_attn\.qkv_proj is a LoRALinear",
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


@pytest.mark.parametrize(
    ("config_class", "model_class"),
    [
        (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    ],
)
def test_gemmas_scaled_embedding_is_read_from_its_forward(config_class: type, model_class: type) -> None:
    """``super().forward(ids) * self.embed_scale.to(self.weight.dtype)``: under tp the vocabulary-parallel
    lookup is scaled alike; a scale that is no attribute of the module (``ScaledEmbedding``) is refused."""
    config = config_class(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = model_class(config)
    assert embedding_scale(model.get_input_embeddings()) == EmbeddingScale("embed_scale", cast=True)
    check_hf_model(model, ParallelDims(tp=2))
    assert embedding_scale(nn.Embedding(4, 2)) is NO_SCALE
    assert embedding_scale(ScaledEmbedding(4, 2)) is None


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


class NormalizingDecoder(nn.Module):
    """Scales the embeddings by a local tensor before its layers, as Gemma's decoder did before its embedding
    module scaled itself: a later stage, handed hidden states, would scale them again."""

    def forward(self, input_ids=None, inputs_embeds=None):  # type: ignore[no-untyped-def]
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds
        normalizer = torch.tensor(8.0, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def test_pp_with_embeddings_changed_before_the_layers_is_refused_unless_a_stage_can_undo_it() -> None:
    """Granite's multiplier and StarCoder2's embedding dropout are attributes a later stage sets to 1 / 0; a
    change the stage cannot undo is refused by name."""
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3ForCausalLM: pp > 1: NormalizingDecoder\.forward changes the embeddings before its layers "
        r"\(hidden_states = hidden_states \* normalizer\), which a later stage, handed hidden states, would "
        r"repeat; use pp=1$",
    ):
        embedding_steps(tiny(), NormalizingDecoder())
    granite = transformers.GraniteForCausalLM(
        transformers.GraniteConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, embedding_multiplier=12.0,
        )
    )  # fmt: skip
    assert embedding_steps(granite, granite.model) == {"embedding_multiplier": 1.0}
    coder = transformers.Starcoder2ForCausalLM(
        transformers.Starcoder2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, embedding_dropout=0.1,
        )
    )  # fmt: skip
    assert embedding_steps(coder, coder.model) == {"embedding_dropout": 0.0}
    assert embedding_steps(tiny(), tiny().model) == {}
