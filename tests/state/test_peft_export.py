"""A LoRA-adapted model's adapters as a ``peft`` adapter directory: ``peft.PeftModel.from_pretrained`` on the
``transformers`` base gives the adapted model's logits, from one process and from sharded ranks (tp=2, FSDP);
the adapter config names the layers and refuses what peft cannot express."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from distributed import run_distributed
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.lora import LoRA, apply_lora
from lightning_d9d.state import CheckpointError
from lightning_d9d.state.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter

CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def base_model() -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).eval()


def adapted(lora: LoRA) -> nn.Module:
    """The base with adapters whose B is not zero (a zero B would make any export of B look right)."""
    model = base_model()
    apply_lora(model, lora, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def peft_logits(adapter: Path) -> torch.Tensor:
    loaded = peft.PeftModel.from_pretrained(base_model(), str(adapter))
    with torch.no_grad():
        return loaded(IDS).logits


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


def _export_sharded(directory: str, dims: dict[str, int]) -> None:
    model = adapted(LORA)
    mesh = ParallelDims(**dims).resolve(torch.distributed.get_world_size()).build_mesh("cpu")
    parallelize_hf(model, mesh, ParallelOptions())
    save_peft_adapter(model, directory)


@pytest.mark.parametrize("dims", [{"tp": 2}, {"dp_shard": 2}], ids=["tp2", "dp_shard2"])
def test_sharded_adapters_export_whole(tmp_path: Path, dims: dict[str, int]) -> None:
    """Every adapter gathered from its shards (tp splits A or B with their layers, FSDP splits both): the same
    directory one process writes."""
    run_distributed(_export_sharded, 2, str(tmp_path / "adapter"), dims)
    with torch.no_grad():
        expected = adapted(LORA)(IDS).logits
    torch.testing.assert_close(peft_logits(tmp_path / "adapter"), expected, atol=1e-5, rtol=0)


def test_what_peft_cannot_express_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no LoRA adapters"):
        save_peft_adapter(base_model(), tmp_path / "none")
    model = adapted(LORA)
    model.get_submodule("model.layers.0.self_attn.q_proj").lora_dropout = nn.Dropout(0.1)
    with pytest.raises(CheckpointError, match=r"several dropout rates \(\[0.0, 0.1\]\)"):
        save_peft_adapter(model, tmp_path / "dropouts")
    assert not (tmp_path / "dropouts").exists()
