"""``transformers``' own files in and out of a run on a transformers model: a multi-shard ``save_pretrained``
checkpoint streamed by ``LoadHFWeights`` into ``tp=2 × dp_shard=2`` (and into pipeline stages), trained, written by
``ExportHF`` as several shards, and read back by ``AutoModelForCausalLM.from_pretrained`` as the class the run
trained (``architectures`` names it, not the class FSDP made): the original's logits when nothing trained (fp32,
1e-5), the one-process run's parameters when it trained. Dense (Qwen3, Llama) and Qwen3-MoE, whose per-expert
files become its fused in-memory experts and back. A training checkpoint of the FSDP run converts with ``dcp-to-hf``
without ``--config`` to the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_parity_run import BATCHES
from safetensors.torch import load_file
from tiny_hf import FAMILIES, batch, reference_run, tiny_causal_lm

from lightning_d9d.convert import main as convert_main
from lightning_d9d.state.errors import ConfigMismatchError
from lightning_d9d.state.hf import load_hf
from lightning_d9d.state.reader import INDEX_NAME


def saved_pretrained(family: str, directory: Path) -> torch.nn.Module:
    """Another model than the runs build (seed 7, not 0), saved by ``save_pretrained`` in several files."""
    torch.manual_seed(7)
    model = tiny_causal_lm(family)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory, max_shard_size="40KB")
    assert len(list(directory.glob("*.safetensors"))) > 2 and (directory / INDEX_NAME).is_file()
    return model


RUNS: dict[str, dict[str, Any]] = {
    # nothing trains (lr 0): what comes out is what went in
    # and a training checkpoint of the last step, which dcp-to-hf converts to the same files
    "qwen3_tp2_dp2_roundtrip": {
        "family": "qwen3",
        "devices": 4,
        "dims": {"tp": 2, "dp_shard": 2},
        "lr": 0.0,
        "save_every": BATCHES,
    },
    # (Llama's files go through the same adapter path: its round trip is the pipelined run below, which keeps
    # the suite inside CI's time; a 4-process Llama round trip beside Qwen3's added ~25 s)
    "qwen3_moe_ep2_roundtrip": {"family": "qwen3_moe", "devices": 2, "dims": {"ep": 2}, "lr": 0.0},
    # trained in between, under pipeline stages (each rank loads and exports its stage)
    "llama_pp2_trained": {
        "family": "llama",
        "devices": 2,
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


ORIGINALS: dict[str, torch.nn.Module] = {}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {key: value for file in directory.glob("*.safetensors") for key, value in load_file(file).items()}


def prepare_runs(out: Path) -> dict[str, dict[str, Any]]:
    """The runs with their directories: each loads its own save_pretrained files (written here) and exports."""
    runs = {}
    for name, run in RUNS.items():
        ORIGINALS[name] = saved_pretrained(run["family"], out / f"{name}_pretrained")
        runs[name] = {
            **run,
            "layers": 2,
            "load_hf": str(out / f"{name}_pretrained"),
            "export_hf": str(out / name),
        }
        if "save_every" in run:
            runs[name]["ckpt_dir"] = str(out / f"{name}_ckpt")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_hf_files_round_trip_through_a_parallel_run(parity_results: dict[str, Any], name: str) -> None:
    run, got, original = RUNS[name], parity_results[f"{__name__}.{name}"], ORIGINALS[name]
    exported = Path(got["export_dir"]) / "final"
    assert len(list(exported.glob("*.safetensors"))) > 1 and (exported / INDEX_NAME).is_file()
    assert all(torch.equal(got["start"][n], p.detach()) for n, p in original.named_parameters())  # loaded
    model_class = FAMILIES[run["family"]][1]
    assert json.loads((exported / "config.json").read_text())["architectures"] == [model_class.__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(back) is model_class
    if "save_every" in run:  # the config recorded in the checkpoint names the class: no --config needed
        converted = Path(got["export_dir"]).with_name(f"{name}_converted")
        checkpoint = Path(got["export_dir"]).with_name(f"{name}_ckpt") / f"step={BATCHES}.ckpt"
        assert convert_main(["dcp-to-hf", str(checkpoint), str(converted)]) == 0
        assert json.loads((converted / "config.json").read_text())["architectures"] == [model_class.__name__]
        written, reference = _tensors(converted), _tensors(exported)
        assert written.keys() == reference.keys()
        assert all(torch.equal(written[key], value) for key, value in reference.items())
    ids = batch(0)[0]
    if run.get("lr") == 0.0:
        expected = original(input_ids=ids).logits
        assert float((back(input_ids=ids).logits - expected).abs().max()) <= 1e-5
        return
    expected_params = reference_run(original, BATCHES)["params"]
    for param_name, param in back.named_parameters():
        assert float((param.detach() - expected_params[param_name]).abs().max()) <= 1e-5, param_name


def test_files_of_another_model_are_refused_naming_the_fields(tmp_path: Path) -> None:
    tiny_causal_lm("llama").save_pretrained(tmp_path / "llama")
    tiny_causal_lm("llama", intermediate_size=96).save_pretrained(tmp_path / "narrow")
    with pytest.raises(ConfigMismatchError, match=r"describes another model: model_type 'llama'"):
        load_hf(tiny_causal_lm("qwen3"), tmp_path / "llama")
    with pytest.raises(ConfigMismatchError, match=r"intermediate_size is 96 there but 128 in the module"):
        load_hf(tiny_causal_lm("llama"), tmp_path / "narrow")
