"""Qwen3-MoE ↔ Hugging Face: transformers' per-expert files (what ``save_pretrained`` writes) and its fused
in-memory layout read into our stacked experts, written back, and loaded by ``transformers`` with equal logits;
on one process, on FSDP over 2 gloo ranks, and through ``python -m lightning_d9d.convert``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from hf_fsdp import check_fsdp_load_and_export
from hf_helpers import batch, config_json, hf_logits, load_transformers
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_d9d.convert import main
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.state import INDEX_NAME, infer_shapes
from lightning_d9d.state.hf import QWEN3_MOE, check_same_model, hf_format, load_hf, save_hf

TOLERANCE = 1e-5
VOCAB = 96
# Layer 1 dense (mlp_only_layers), 0 and 2 sparse; 6 experts, top-2.
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=[1],
    max_position_embeddings=64,
)


def make_moe_checkpoint(directory: Path, *, fused: bool = False, **overrides: Any) -> Any:
    """A random fp32 ``transformers.Qwen3MoeForCausalLM`` saved in ``directory`` (``save_pretrained``: one
    matrix per expert; ``fused``: its raw state dict, stacked experts); returns the model (eval mode)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)  # HF starts norms at 1: a swapped norm would not show
            if "mlp.gate.weight" in name:
                param.normal_(0.0, 0.5)  # decisive routing
    if fused:
        directory.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(directory / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (directory / "config.json").write_text(json.dumps(config.to_dict()))
    else:
        model.save_pretrained(directory)
    return model


def _our_model(directory: Path) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.from_hf_dict(config_json(directory)))


def _file_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def test_mapping_covers_the_files_transformers_writes_and_our_module(tmp_path: Path) -> None:
    make_moe_checkpoint(tmp_path / "hf")
    written = config_json(tmp_path / "hf")
    assert "num_local_experts" in written  # transformers 5's name for num_experts
    assert hf_format(written) is QWEN3_MOE
    files = _file_shapes(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in files  # per expert, as on the hub
    assert files == QWEN3_MOE.hf_shapes(written, "per_expert")  # type: ignore[misc]
    ours = _our_model(tmp_path / "hf")
    expected = {key: tuple(value.shape) for key, value in ours.state_dict().items()}
    for layout in ("per_expert", "fused"):
        mapped = infer_shapes(QWEN3_MOE.from_hf(written, layout), QWEN3_MOE.hf_shapes(written, layout))  # type: ignore[misc]
        assert {key: tuple(shape) for key, shape in mapped.items()} == expected, layout
    # Our own config.json (num_experts) and transformers' (num_local_experts) are the same model.
    check_same_model(written, ours.config.to_hf_dict(), path="config.json")


def test_one_process_load_and_export_match_transformers(tmp_path: Path) -> None:
    hf = make_moe_checkpoint(tmp_path / "hf")
    ids = batch(VOCAB)
    expected = hf_logits(hf, ids)
    ours = _our_model(tmp_path / "hf")
    load_hf(ours, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), expected, rtol=TOLERANCE, atol=TOLERANCE)

    save_hf(ours, tmp_path / "export", max_shard_bytes=30_000)  # several shards and an index
    assert (tmp_path / "export" / INDEX_NAME).is_file()
    assert _file_shapes(tmp_path / "export") == _file_shapes(tmp_path / "hf")  # the per-expert layout
    back = load_transformers(tmp_path / "export")
    torch.testing.assert_close(hf_logits(back, ids), expected, rtol=TOLERANCE, atol=TOLERANCE)
    for key, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_fused_layout_loads_and_converts_to_the_per_expert_one(tmp_path: Path) -> None:
    hf = make_moe_checkpoint(tmp_path / "fused", fused=True)
    ids = batch(VOCAB)
    expected = hf_logits(hf, ids)
    ours = _our_model(tmp_path / "fused")
    load_hf(ours, tmp_path / "fused")  # the layout is told from the keys
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), expected, rtol=TOLERANCE, atol=TOLERANCE)

    assert main(["hf-to-hf", str(tmp_path / "fused"), str(tmp_path / "out")]) == 0
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in _file_shapes(tmp_path / "out")
    back = load_transformers(tmp_path / "out")
    torch.testing.assert_close(hf_logits(back, ids), expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_fsdp_two_processes_load_and_export_match_transformers(tmp_path: Path) -> None:
    # 5 experts: uneven expert shards (3 + 2)
    hf = make_moe_checkpoint(tmp_path / "hf", num_experts=5)
    shards = [(experts, SMALL["hidden_size"], 2 * SMALL["moe_intermediate_size"]) for experts in (3, 2)]
    check_fsdp_load_and_export(
        _our_model,
        "model.layers.0.mlp.experts.gate_up_proj",
        shards,
        hf,
        batch(VOCAB),
        tmp_path / "hf",
        tmp_path,
        TOLERANCE,
    )
