"""A LoRA-adapted model's adapters as a ``peft`` adapter directory: ``peft.PeftModel.from_pretrained`` on the
``transformers`` base gives the adapted model's logits, from one process and from sharded ranks (tp=2, FSDP, ep=2
with adapted experts); the adapter config names the layers and refuses what peft cannot express. Adapters on
stacked experts (a ``transformers`` Qwen3-MoE's, our Qwen3-MoE's) go out as peft's ``target_parameters``; the
merge mapper folds every adapter into its weight."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import safetensors
import torch
import transformers
from distributed import run_distributed
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.lora import LoRA, apply_lora
from lightning_d9d.state import CheckpointError
from lightning_d9d.state.hf import QWEN3_MOE
from lightning_d9d.state.hf.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_keys,
    merge_mapper,
    save_peft_adapter,
)

CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
MOE_CONFIG = {**CONFIG, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def base_model() -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).eval()


def moe_base_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**MOE_CONFIG)
    config._attn_implementation = "eager"  # as our Qwen3-MoE computes attention
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # spread the router logits: decisive top-k, which float rounding does not flip
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def our_moe_model() -> Qwen3MoeForCausalLM:
    """Our Qwen3-MoE holding ``moe_base_model``'s weights (through the Hugging Face mapping)."""
    hf = moe_base_model()
    config = Qwen3MoeConfig.from_hf_dict(hf.config)
    mapper = QWEN3_MOE.from_hf(config.to_hf_dict(), "fused")
    state = hf.state_dict()
    ours = Qwen3MoeForCausalLM(config).eval()
    for group in mapper.groups():
        ours.load_state_dict(mapper.apply({key: state[key] for key in group.inputs}), strict=False)
    return ours


def adapted(lora: LoRA, build: Callable[[], nn.Module] = base_model) -> nn.Module:
    """The base with adapters whose B is not zero (a zero B would make any export of B look right)."""
    model = build()
    apply_lora(model, lora, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return out if isinstance(out, torch.Tensor) else out.logits


def peft_logits(adapter: Path, build: Callable[[], nn.Module] = base_model) -> torch.Tensor:
    return logits(peft.PeftModel.from_pretrained(build(), str(adapter)))


LORA = LoRA(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


def test_peft_loads_the_adapter_onto_the_transformers_base(tmp_path: Path) -> None:
    model = adapted(LORA)
    with torch.no_grad():
        expected = model(IDS).logits
        plain = base_model()(IDS).logits
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="my/base")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == "my/base" and (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == sorted(
        f"model.layers.{i}.{part}"
        for i in range(2)
        for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    got = peft_logits(tmp_path / "adapter")
    assert (expected - plain).abs().max() > 1e-2  # the adapters change the logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


EXPERTS = LoRA(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), experts=True)
SHARDED = {  # dims, adapters, base
    "tp2": ({"tp": 2}, LORA, base_model),
    "dp_shard2": ({"dp_shard": 2}, LORA, base_model),
    "ep2_experts": ({"dp_shard": 2, "ep": 2}, EXPERTS, moe_base_model),
}


def _export_sharded(directory: str, case: str) -> None:
    dims, lora, build = SHARDED[case]
    model = adapted(lora, build)
    mesh = ParallelDims(**dims).resolve(torch.distributed.get_world_size()).build_mesh("cpu")
    parallelize_hf(model, mesh, ParallelOptions())
    save_peft_adapter(model, directory)


@pytest.mark.parametrize("case", sorted(SHARDED))
def test_sharded_adapters_export_whole(tmp_path: Path, case: str) -> None:
    """Every adapter gathered from its shards (tp splits A or B with their layers, FSDP splits both, ep splits the
    experts' adapters with their experts): the same directory one process writes."""
    run_distributed(_export_sharded, 2, str(tmp_path / "adapter"), case)
    _, lora, build = SHARDED[case]
    expected = logits(adapted(lora, build))
    torch.testing.assert_close(peft_logits(tmp_path / "adapter", build), expected, atol=1e-5, rtol=0)


def _without_experts_updates(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts.lora.lora_B." in name:
                param.zero_()
    return logits(model)


@pytest.mark.parametrize("ours", [False, True], ids=["transformers_qwen3_moe", "our_qwen3_moe"])
def test_peft_loads_the_experts_adapters_onto_the_transformers_base(tmp_path: Path, ours: bool) -> None:
    """Adapters on stacked experts (transformers' ``[E, out, in]``, ours ``[E, in, out]``) go out as peft's
    target_parameters, nested per module, and peft's forward on the transformers base gives our logits."""
    model = adapted(EXPERTS, our_moe_model if ours else moe_base_model)
    expected = logits(model)
    save_peft_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{weight}" for i in range(2) for weight in ("down_proj", "gate_up_proj")
    ]
    assert config["target_modules"] == [
        f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qv"
    ]
    with safetensors.safe_open(tmp_path / "adapter" / ADAPTER_WEIGHTS, "pt") as stored:
        shapes = {key: tuple(stored.get_slice(key).get_shape()) for key in stored.keys()}  # noqa: SIM118
    experts = "base_model.model.model.layers.0.mlp.experts"
    assert shapes[f"{experts}.base_layer.lora_A.weight"] == (4 * 4, 64)  # gate_up_proj: [E * r, hidden]
    assert shapes[f"{experts}.base_layer.lora_B.weight"] == (2 * 32, 4 * 4)  # [2 * ffn, r * E]
    assert shapes[f"{experts}.lora_A.weight"] == (4 * 4, 32)  # down_proj: [E * r, ffn]
    got = peft_logits(tmp_path / "adapter", moe_base_model)
    assert (expected - _without_experts_updates(model)).abs().max() > 1e-2  # the experts' adapters count
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("build", "lora"),
    [(base_model, LORA), (moe_base_model, EXPERTS), (our_moe_model, EXPERTS)],
    ids=["transformers_qwen3", "transformers_qwen3_moe", "our_qwen3_moe"],
)
def test_the_merged_weights_compute_the_adapted_model(build: Callable[[], nn.Module], lora: LoRA) -> None:
    """The merge mapper's weights (``W + (alpha / r) B A``; per expert, in the layout the weight holds) in the
    base model give the adapted model's logits."""
    model = adapted(lora, build)
    state = model.state_dict()
    mapper = merge_mapper(model)
    assert mapper is not None
    merged = {key: value for key, value in state.items() if key not in adapter_keys(model)}
    for group in mapper.groups():
        merged.update(mapper.apply({key: state[key] for key in group.inputs}))
    base = build()
    base.load_state_dict(merged, strict=True)
    assert (logits(model) - logits(build())).abs().max() > 1e-2
    torch.testing.assert_close(logits(base), logits(model), atol=1e-5, rtol=0)


def test_what_peft_cannot_express_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no LoRA adapters"):
        save_peft_adapter(base_model(), tmp_path / "none")
    model = adapted(LORA)
    model.get_submodule("model.layers.0.self_attn.q_proj").lora_dropout = nn.Dropout(0.1)
    with pytest.raises(CheckpointError, match=r"several dropout rates \(\[0.0, 0.1\]\)"):
        save_peft_adapter(model, tmp_path / "dropouts")
    assert not (tmp_path / "dropouts").exists()
    dropout = adapted(LoRA(rank=4, targets=("q_proj",), dropout=0.1, experts=True), moe_base_model)
    with pytest.raises(
        CheckpointError,
        match=r"stacked experts \(model.layers.0.mlp.experts.down_proj, ...\) train with dropout 0.1; peft .* "
        "target_parameters, which take no dropout",
    ):
        save_peft_adapter(dropout, tmp_path / "experts_dropout")
    assert not (tmp_path / "experts_dropout").exists()


def test_the_format_names_the_experts_adapter_as_the_blocks_do() -> None:
    """``state/hf/peft.py`` keeps its own copy of the attribute name (it must not import the blocks, which pull in
    Lightning for ``python -m lightning_d9d.convert``)."""
    import lightning_d9d.modules.lora as blocks
    import lightning_d9d.state.hf.peft as format_

    assert format_.EXPERTS_ADAPTER == blocks.EXPERTS_ADAPTER
    assert blocks.__name__ == format_._LORA_BLOCKS
