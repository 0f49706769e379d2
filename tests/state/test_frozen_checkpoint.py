"""A LoRA run's training checkpoint (``lightning_d9d.state.frozen``): the frozen base is left out and fingerprinted;
a resume onto the same base loads the adapters and their optimizer state, onto another base it is refused before
anything is touched. The Trainer's side (save, resume mid-epoch on another layout, bit for bit on the same one)
runs in ``tests/strategies/test_lora_parity.py``."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_d9d.convert import main as convert_main
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.plans.lora import LoRA, apply_lora
from lightning_d9d.state import CheckpointError
from lightning_d9d.state.frozen import FINGERPRINT_KEY, fingerprint, frozen_names
from lightning_d9d.state.training import MODEL_SECTION, load, optimizer_state, read_dcp_metadata, save


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


# wide enough that the files' own overhead does not hide the sizes: 1.5M parameters, 35K of them adapters
SHAPE = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "head_dim": 64,
}


def adapted(base_seed: int, adapter_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny Qwen3 (its base drawn from ``base_seed``) with adapters, one AdamW step taken on them."""
    torch.manual_seed(base_seed)
    model = Qwen3ForCausalLM(Qwen3Config.tiny(**SHAPE))
    apply_lora(model, LoRA(rank=4), seed=adapter_seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(adapter_seed)
    model(torch.randint(0, 2048, (2, 16))).float().square().mean().backward()
    optimizer.step()
    return model, optimizer


def lora_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What D9DStrategy hands the format under LoRA: the state without the frozen base, and its fingerprint."""
    frozen = frozen_names(model)
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items() if k not in frozen},
        "optimizer_states": [optimizer_state(model, optimizer)],
        FINGERPRINT_KEY: fingerprint(model),
    }


def resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What D9DStrategy's load does under LoRA: the checkpoint, checked against the model's base fingerprint."""
    return load(path, model, {0: optimizer}, strict=True, weights_only=True, frozen=fingerprint(model))


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")


def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_on_the_same_base(tmp_path: Path) -> None:
    model, optimizer = adapted(base_seed=0, adapter_seed=1)
    save(tmp_path / "lora.ckpt", lora_checkpoint(model, optimizer))
    full = {"state_dict": model.state_dict(), "optimizer_states": [optimizer_state(model, optimizer)]}
    save(tmp_path / "full.ckpt", full)
    model_keys = {
        key.removeprefix(f"{MODEL_SECTION}.")
        for key in read_dcp_metadata(tmp_path / "lora.ckpt").state_dict_metadata
        if key.startswith(f"{MODEL_SECTION}.")
    }
    assert model_keys == {n for n, p in model.named_parameters() if p.requires_grad} | {
        n for n, _ in model.named_buffers() if n in model.state_dict()
    }
    # the adapters and their AdamW moments: a small fraction of the whole model's checkpoint
    lora_bytes, full_bytes = stored_bytes(tmp_path / "lora.ckpt"), stored_bytes(tmp_path / "full.ckpt")
    print(f"LoRA checkpoint {lora_bytes} bytes, full {full_bytes} bytes")
    assert lora_bytes < full_bytes / 10, (lora_bytes, full_bytes)

    other, other_optimizer = adapted(base_seed=0, adapter_seed=2)  # the same base, other adapters
    base_before = {n: p.detach().clone() for n, p in other.named_parameters() if not p.requires_grad}
    resume(tmp_path / "lora.ckpt", other, other_optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    assert all(torch.equal(p, base_before[n]) for n, p in other.named_parameters() if not p.requires_grad)
    state = other_optimizer.state_dict()["state"]
    expected = optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg"], expected[i]["exp_avg"]) for i in expected)


def test_a_lora_checkpoint_refuses_another_base_before_touching_the_model(tmp_path: Path) -> None:
    model, optimizer = adapted(base_seed=0, adapter_seed=1)
    save(tmp_path / "lora.ckpt", lora_checkpoint(model, optimizer))
    other, other_optimizer = adapted(base_seed=3, adapter_seed=2)  # a base the adapters were not trained on
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(
        CheckpointError,
        match=r"holds the trained parameters only, and the model's frozen \S+ is not the one it was trained on",
    ):
        resume(tmp_path / "lora.ckpt", other, other_optimizer)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    # the base in another dtype is another base too
    bf16, bf16_optimizer = adapted(base_seed=0, adapter_seed=2)
    for param in bf16.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16).float()
    with pytest.raises(CheckpointError, match="is not the one it was trained on"):
        resume(tmp_path / "lora.ckpt", bf16, bf16_optimizer)


def test_the_fingerprint_is_each_frozen_parameter_s_float64_sum_and_sum_of_squares() -> None:
    """On one process, checked against torch's own sums (the sharded path, summed over the mesh dims a shard is cut
    on, runs under the Trainer's resume onto another layout in test_lora_parity.py)."""
    model, _ = adapted(base_seed=0, adapter_seed=1)
    whole = fingerprint(model)
    total, squares, numel = whole["model.embed_tokens.weight"]
    weight = model.get_submodule("model.embed_tokens").weight.detach().double()
    assert numel == weight.numel()
    assert abs(total - float(weight.sum())) <= 1e-12 * abs(float(weight.abs().sum()))
    assert abs(squares - float(weight.square().sum())) <= 1e-12 * squares


def test_dcp_to_hf_refuses_a_lora_checkpoint_naming_the_missing_base_and_the_fixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA checkpoint holds no frozen base, so it converts to no model: refused before any tensor is read,
    with what is missing, the folder the base came from, and the exports that hold the adapters."""
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    apply_lora(model, LoRA(rank=2), seed=1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    base = str(tmp_path / "qwen3-base")
    recorded = {
        "callbacks": {
            f"LoadHFWeights{{'path': {base!r}}}": {"source": base, "hf_config": model.config.to_hf_dict()}
        }
    }
    save(tmp_path / "lora.ckpt", {**lora_checkpoint(model, optimizer), **recorded})
    frozen = sorted(frozen_names(model))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    for extra in ([], ["--config", str(tmp_path / "config.json")], ["--no-verify"]):
        assert convert_main(["dcp-to-hf", str(tmp_path / "lora.ckpt"), str(tmp_path / "out"), *extra]) == 1
        error = capsys.readouterr().err
        assert f"{tmp_path / 'lora.ckpt'} is a LoRA run's checkpoint" in error, error
        assert f"not the base its adapters were trained on ({len(frozen)} tensors: {frozen[0]!r}, " in error
        assert f"its base was loaded from {base}" in error
        assert "ExportHF(dirpath, lora='merged' | 'adapter' | 'both')" in error
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recorded", [["not", "a", "mapping"], {"model.norm.weight": "x"}, {"w": (1.0, 2.0)}])
def test_a_crafted_fingerprint_is_refused_by_name(tmp_path: Path, recorded: object) -> None:
    model, optimizer = adapted(base_seed=0, adapter_seed=1)
    checkpoint = lora_checkpoint(model, optimizer)
    checkpoint[FINGERPRINT_KEY] = recorded
    save(tmp_path / "lora.ckpt", checkpoint)
    with pytest.raises(CheckpointError, match="is not a fingerprint of frozen parameters"):
        resume(tmp_path / "lora.ckpt", model, optimizer)
