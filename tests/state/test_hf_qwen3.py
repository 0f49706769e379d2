"""Qwen3 ↔ Hugging Face: the mapping, the config check, and logits parity with ``transformers`` on 1 process and
on FSDP over 2 gloo ranks, through our reader into our model and back out through our writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from distributed import run_distributed
from hf_fsdp import check_fsdp_load_and_export
from hf_helpers import SMALL, batch, config_json, hf_logits, load_transformers, make_hf_checkpoint

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.state import INDEX_NAME, KeyCoverageError, check_coverage, infer_shapes
from lightning_d9d.state.hf import (
    QWEN3,
    check_same_model,
    hf_format,
    load_hf,
    qwen3_hf_shapes,
    qwen3_signature,
    save_hf,
)

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"tie_word_embeddings": True},
        {"attention_bias": True, "num_hidden_layers": 3},
    ],
)
def test_mapping_covers_transformers_and_our_module(overrides: dict[str, Any]) -> None:
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SMALL, **overrides}))
    config = hf.config.to_dict()
    file_keys = {key: tuple(value.shape) for key, value in hf.state_dict().items()}
    if overrides.get("tie_word_embeddings"):
        del file_keys["lm_head.weight"]  # what save_pretrained writes for a tied model
    mapper = QWEN3.from_hf(config)
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(config))
    module_keys = [key for key, _ in ours.named_parameters()]  # tied weights once, like the mapping
    check_coverage(mapper, source_keys=file_keys, target_keys=module_keys)
    assert qwen3_hf_shapes(config) == file_keys
    assert infer_shapes(mapper, file_keys) == {k: tuple(p.shape) for k, p in ours.named_parameters()}
    # Our config, written out, describes the same model as transformers' own.
    check_same_model(ours.config.to_hf_dict(), config, path="ours")


def test_signature_reads_configs_of_both_transformers_generations() -> None:
    v5 = transformers.Qwen3Config(**SMALL).to_dict()  # rope_theta inside rope_parameters
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "head_dim", "num_key_value_heads")}
    v4.update(rope_theta=SMALL["rope_theta"], num_key_value_heads=None)  # 4.x: top-level theta, derived sizes
    v4["head_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    v4["num_key_value_heads"] = SMALL["num_key_value_heads"]
    assert qwen3_signature(v4) == qwen3_signature(v5)
    assert hf_format({"architectures": ["Qwen3ForCausalLM"]}) is QWEN3  # no model_type: by architecture


def _our_model(directory: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config.from_hf_dict(config_json(directory)))


@pytest.mark.parametrize("tied", [False, True])
def test_one_process_load_and_export_match_transformers(tied: bool, tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=tied)
    ids = batch(SMALL["vocab_size"])
    expected = hf_logits(hf, ids)

    ours = _our_model(tmp_path / "hf")
    load_hf(ours, tmp_path / "hf")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), expected, rtol=TOLERANCE, atol=TOLERANCE)

    save_hf(ours, tmp_path / "export", max_shard_bytes=30_000)  # several shards and an index
    assert (tmp_path / "export" / INDEX_NAME).is_file()
    back = load_transformers(tmp_path / "export")
    torch.testing.assert_close(hf_logits(back, ids), expected, rtol=TOLERANCE, atol=TOLERANCE)
    exported = set(back.state_dict())
    for key, value in hf.state_dict().items():
        assert key in exported and torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_two_processes_load_and_export_match_transformers(tied: bool, tmp_path: Path) -> None:
    # 97 rows: uneven embedding shards (49 + 48)
    hf = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=tied, vocab_size=97)
    shards = [(rows, SMALL["hidden_size"]) for rows in (49, 48)]
    check_fsdp_load_and_export(
        _our_model, "model.embed_tokens.weight", shards, hf, batch(97), tmp_path / "hf", tmp_path, TOLERANCE
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "export",
        "hf",
        "rank0.pt",
        "rank1.pt",
    ]  # no temporaries


def test_bf16_file_into_fp32_weights_and_back(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    ours = _our_model(tmp_path / "hf")
    load_hf(ours, tmp_path / "hf")  # cast=True by default
    assert ours.model.norm.weight.dtype == torch.float32
    assert torch.equal(ours.model.norm.weight, hf.model.norm.weight.float())
    save_hf(ours, tmp_path / "bf16", dtype=torch.bfloat16)
    assert config_json(tmp_path / "bf16")["dtype"] == "bfloat16"
    back = load_transformers(tmp_path / "bf16")
    assert torch.equal(back.model.norm.weight, hf.model.norm.weight)
    with pytest.raises(Exception, match="Cast"):  # without cast the dtypes must agree
        load_hf(_our_model(tmp_path / "hf"), tmp_path / "hf", cast=False)


def test_tied_model_from_a_file_that_also_holds_the_head(tmp_path: Path) -> None:
    """Some tools write lm_head.weight even for tied models: it is not read, and the embedding is loaded. A graph
    that would fill it as well is refused by name: tied weights count once, under the first state-dict name."""
    from safetensors.torch import load_file, save_file

    from lightning_d9d.state import Identity, Parallel, load_into_module

    hf = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=True)
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])  # would break the tie
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ours = _our_model(tmp_path / "hf")
    load_hf(ours, tmp_path / "hf")
    assert torch.equal(ours.lm_head.weight, hf.model.embed_tokens.weight)

    mapper = Parallel([QWEN3.from_hf(ours.config.to_hf_dict()), Identity(["lm_head.weight"])])
    with pytest.raises(KeyCoverageError) as raised:
        load_into_module(ours, tmp_path / "hf", mapper)
    assert raised.value.unexpected_target == ["lm_head.weight"]
    assert "'lm_head.weight' is 'model.embed_tokens.weight'" in str(raised.value)


def _stage(model: Qwen3ForCausalLM, rank: int) -> torch.nn.Module:
    """What a pipeline stage holds of the model, under the global names: rank 0 the embedding and layer 0,
    rank 1 layer 1, the final norm and the head."""
    stage, decoder, layers = torch.nn.Module(), torch.nn.Module(), torch.nn.ModuleDict()
    layers[str(rank)] = model.get_submodule(f"model.layers.{rank}")
    decoder.layers = layers
    if rank == 0:
        decoder.embed_tokens = model.model.embed_tokens
    else:
        decoder.norm = model.model.norm
        stage.lm_head = model.lm_head
    stage.model = decoder
    return stage


def _pipeline_rank(directory: Path, out: Path) -> dict[str, torch.Tensor]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(100 + rank)
    stage = _stage(_our_model(directory), rank)
    config = config_json(directory)
    load_hf(stage, directory, config, partial=True)
    save_hf(stage, out, config, partial=True, max_shard_bytes=30_000)  # each part written by its own rank
    return {key: value.detach().clone() for key, value in stage.state_dict().items()}


def test_pipeline_stages_load_their_part_and_export_together(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=False)
    parts = run_distributed(_pipeline_rank, 2, tmp_path / "hf", tmp_path / "export", timeout=120)
    expected = hf.state_dict()
    assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == set(expected)
    for part in parts:
        for key, value in part.items():
            assert torch.equal(value, expected[key]), key
    ids = batch(SMALL["vocab_size"])
    back = load_transformers(tmp_path / "export")
    torch.testing.assert_close(hf_logits(back, ids), hf_logits(hf, ids), rtol=TOLERANCE, atol=TOLERANCE)
    # Without partial, a stage is not the whole model, and says so.
    with pytest.raises(KeyCoverageError, match=r"model\.layers\.1\."):
        load_hf(_stage(_our_model(tmp_path / "hf"), 0), tmp_path / "hf", config_json(tmp_path / "hf"))
