"""benchmarks/lora_throughput.py, the LoRA benchmark of one GPU: its three paths train on the CPU (a broken path
would otherwise show only on a GPU), its FLOPs count the adapters and the frozen base apart, and a baseline that runs
out of memory moves the run to the next shape instead of failing it."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lora_throughput as lt
import train_throughput as tt

from lightning_d9d.models import Qwen3Config
from lightning_d9d.modules.loss import causal_lm_loss

OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _adapter_params(config: Qwen3Config, rank: int) -> int:
    """``rank x (in + out)`` for each of a decoder layer's seven projections, over the layers."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    sides = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return config.num_hidden_layers * rank * sides


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks traced by dynamo but run eagerly (no Inductor code generation: minutes on 2 cores)."""
    compile_module = nn.Module.compile

    def traced(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        compile_module(self, *args, **{**kwargs, "backend": "eager", "mode": None})

    monkeypatch.setattr(nn.Module, "compile", traced)


def test_the_three_paths_train_the_same_adapters_from_the_same_weights_on_the_cpu(
    eager_compile: None, tmp_path: Path
) -> None:
    smoke = (
        "--device=cpu --model=tiny --seq-len=16 --batch-size=2 --warmup=1 --steps=2 --probe-steps=0 --lr=1e-3"
        f" --profile-steps=1 --out={tmp_path}"
    )
    args = tt.parse_args(smoke.split())
    config = tt._config(args)
    results = {}
    for path in lt.DEFAULT_PATHS:
        results[path] = tt.worker(path, args)
        if dist.is_initialized():  # the baseline's one-rank FSDP group
            dist.destroy_process_group()
    for path, result in results.items():
        assert result["ok"], (path, result.get("error"))
        assert len(result["losses"]) == 4 and all(math.isfinite(x) for x in result["losses"]), path
        assert result["trainable_params"] == _adapter_params(config, tt.LORA_RANK), path
        assert (tmp_path / f"profile_{path}.txt").read_text().startswith(f"{path}, 1 profiled steps"), path
    # the loss guard compares like with like: the baseline starts from the weights the strategy gives the
    # transformers model (and our model is given them), the adapters as the LoRA plan starts them, by name and seed
    baseline = results[lt.BASELINE]
    for path in lt.DEFAULT_PATHS[1:]:
        assert results[path]["start"] == baseline["start"], path
        assert results[path]["losses"][0] == pytest.approx(baseline["losses"][0], rel=1e-6), path
    # the same model under each: peft's adapters, ours on transformers' model and on our own
    assert len({r["n_params"] for r in results.values()}) == 1
    for path in lt.DEFAULT_PATHS[1:]:  # the Trainer paths score through model_loss, not a logits wrapper
        assert results[path]["loss_fn"] == repr(causal_lm_loss), path


def test_lora_flops_count_the_adapters_at_six_and_the_frozen_base_at_four() -> None:
    args = tt.parse_args(["--model=tiny", "--seq-len=32"])
    config = tt._config(args)
    adapters = _adapter_params(config, tt.LORA_RANK)
    frozen = config.num_params(include_embedding=False)  # the head counted, the embedding (a lookup) not
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 32
    fpt, params = lt.lora_flops_per_token(args)
    assert (params.trained, params.frozen) == (adapters, frozen)
    assert fpt == 6 * adapters + 4 * frozen + attention


START = {"base": "28a1152a45df9d2f", "adapters": "b09ec980d4ba137a"}


def _measured(path: str, step_ms: float, peak_gib: float, final_loss: float) -> dict[str, Any]:
    return {
        "path": path,
        "ok": True,
        "elapsed_s": 10 * step_ms / 1e3,
        "step_ms": tt._summary([step_ms] * 10),
        "peak_mem_gib": peak_gib,
        "losses": [11.9, final_loss],
        "start": START,
    }


def _fake_gpu(fits: set[str]) -> tuple[lt.RunPath, list[tuple[str, str]]]:
    """A GPU on which the baseline fits only the shapes in ``fits``; ours is 1.4x as fast at 0.6x the memory
    (the transformers model) or 1.1x at 0.9x (our own)."""
    calls: list[tuple[str, str]] = []

    def run(job: int, path: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
        calls.append((args.model, path))
        if path == lt.BASELINE and args.model not in fits:
            result = {"path": path, "ok": False, "error": OOM}
        elif path == lt.BASELINE:
            result = _measured(path, 140.0, 50.0, 10.0)
        elif path.startswith("hf_"):
            result = _measured(path, 100.0, 30.0, 10.1)
        else:
            result = _measured(path, 127.0, 45.0, 10.0)
        return {**result, "job": job, "gpu": "0"}

    return run, calls


def test_a_baseline_out_of_memory_moves_the_run_to_the_next_shape(tmp_path: Path) -> None:
    run, calls = _fake_gpu(fits={"4b"})
    runs = lt.run_shapes(["8b", "4b"], list(lt.DEFAULT_PATHS), ["--device=cpu"], tmp_path, run)
    assert calls == [("8b", lt.BASELINE), *(("4b", path) for path in lt.DEFAULT_PATHS)]
    assert [shape.baseline_fitted for shape in runs] == [False, True]
    assert [r.get("error") for r in runs[0].results[1:]] == [lt.NOT_RUN, lt.NOT_RUN]
    assert lt.failed(runs) == []  # running out of memory is a measurement, not a failure
    report = (tmp_path / "lora_throughput.md").read_text()
    assert "| peft_fsdp_compiled | did not fit (out of memory) |" in report
    assert (
        "| hf_trainer_lora_compiled_nofsdp | 1.40x | 0.60x | +1.00 % | 11.9000 -> 10.1000 | as the baseline's "
        "| met |" in report
    )
    assert "| ours_trainer_lora_compiled_nofsdp | 1.10x | 0.90x | +0.00 % |" in report
    assert "missed: speed, memory |" in report
    for model in ("8b", "4b"):
        assert (tmp_path / model / "lora_throughput.json").is_file()


def test_where_the_baseline_fits_the_first_shape_is_the_only_one(tmp_path: Path) -> None:
    run, calls = _fake_gpu(fits={"8b", "4b"})
    runs = lt.run_shapes(["8b", "4b"], list(lt.DEFAULT_PATHS), ["--device=cpu"], tmp_path, run)
    assert calls == [("8b", path) for path in lt.DEFAULT_PATHS]
    assert [shape.model for shape in runs] == ["8b"] and lt.failed(runs) == []


def test_a_path_that_fails_otherwise_or_leaves_the_loss_band_fails_the_run(tmp_path: Path) -> None:
    run, _ = _fake_gpu(fits={"4b"})

    def broken(job: int, path: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
        result = run(job, path, args, logdir)
        if path.startswith("ours_"):
            return {**result, "ok": False, "error": "RuntimeError: shapes do not match"}
        return {**result, "losses": [11.9, 11.0]} if path.startswith("hf_") else result

    runs = lt.run_shapes(["4b"], list(lt.DEFAULT_PATHS), ["--device=cpu"], tmp_path, broken)
    assert lt.failed(runs) == [
        "4b hf_trainer_lora_compiled_nofsdp: final loss outside the band",
        "4b ours_trainer_lora_compiled_nofsdp: RuntimeError: shapes do not match",
    ]


def test_a_path_that_starts_from_other_weights_fails_the_run(tmp_path: Path) -> None:
    run, _ = _fake_gpu(fits={"8b"})

    def other_adapters(job: int, path: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
        result = run(job, path, args, logdir)
        return {**result, "start": {**START, "adapters": "0"}} if path.startswith("ours_") else result

    runs = lt.run_shapes(["8b"], list(lt.DEFAULT_PATHS), ["--device=cpu"], tmp_path, other_adapters)
    assert lt.failed(runs) == [
        "8b ours_trainer_lora_compiled_nofsdp: started from other weights than the baseline's (adapters): its "
        "loss compares unlike runs"
    ]
    assert (
        "| 11.9000 -> 10.0000 | other adapters | missed: speed, memory |"
        in (tmp_path / "lora_throughput.md").read_text()
    )


def test_the_start_fingerprint_tells_every_bit_and_place_and_reads_peft_names_as_ours() -> None:
    torch.manual_seed(0)
    base, adapter = torch.randn(8, 6).to(torch.bfloat16), torch.randn(4, 6)
    ours = {
        "model.model.layers.0.mlp.up_proj.weight": base,
        "model.model.layers.0.mlp.up_proj.lora_A.weight": adapter,
    }
    peft_names = {
        "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": base.clone(),
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": adapter.clone(),
    }
    start = tt.start_fingerprint(ours.items())
    assert tt.start_fingerprint(peft_names.items()) == start
    flipped = base.clone()
    flipped.view(torch.int16)[3, 2] ^= 1  # the lowest bit of one weight
    swapped = adapter.clone()
    swapped[0, 0], swapped[0, 1] = adapter[0, 1], adapter[0, 0]
    differs = {
        "a bit of the base": {**ours, "model.model.layers.0.mlp.up_proj.weight": flipped},
        "two adapter weights swapped": {**ours, "model.model.layers.0.mlp.up_proj.lora_A.weight": swapped},
        "the base in fp32": {**ours, "model.model.layers.0.mlp.up_proj.weight": base.float()},
        "another layer's name": {
            "model.model.layers.1.mlp.up_proj.weight": base,
            "model.model.layers.0.mlp.up_proj.lora_A.weight": adapter,
        },
    }
    parts = {
        case: [p for p in start if tt.start_fingerprint(named.items())[p] != start[p]]
        for case, named in differs.items()
    }
    assert parts == {
        "a bit of the base": ["base"],
        "two adapter weights swapped": ["adapters"],
        "the base in fp32": ["base"],
        "another layer's name": ["base"],
    }


def test_train_throughput_sends_lora_paths_to_their_own_script() -> None:
    with pytest.raises(
        SystemExit, match=r"\['peft_fsdp_compiled'\] are LoRA paths: run them with .*lora_throughput"
    ):
        tt.main(["--paths", "peft_fsdp_compiled"])
    for wrong in (
        ["--paths", "hf_fsdp_compiled"],
        ["--model", "8b"],
    ):  # a full fine-tune's path; --models' job
        with pytest.raises(SystemExit):
            lt.parse_args(wrong)
