"""The README's first command runs: ``make demo`` is ``examples/pretrain_qwen3.py`` with its defaults (a tiny
Qwen3-MoE on 2 CPU processes); here a shortened run of it, launched as a user would."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_qwen3.py"


def _example_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("pretrain_qwen3", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_trains_the_moe_model_and_reports(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(EXAMPLE), "--max-steps", "30", "--output", str(tmp_path / "run")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    metrics = ast.literal_eval(done[len("done: ") : done.index("}") + 1])  # the dict the demo prints
    assert {"train/loss", "train/router_loss", "val/loss", "val/ppl", "perf/tokens_per_sec"} <= set(metrics)
    # ExpertLoadBalancing is on: the load of both sparse layers (0 and 2; layer 1 is dense) is logged
    assert {f"moe/layer{i}/load_{stat}" for i in (0, 2) for stat in ("min", "max", "cv")} <= set(metrics)
    first = next(line for line in proc.stdout.splitlines() if line.startswith("step   10"))
    assert metrics["train/loss"] < float(first.split()[3]) < 5.6  # it trains: ln(256) = 5.55 at the start
    # the token-weighted perplexity of equal-length batches is exp(mean loss) (both printed to 4 decimals)
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-3)
    assert "dp_shard=2" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    _converts_without_config_and_transformers_reproduces_the_validation_loss(tmp_path, metrics["val/loss"])


def _route_with_the_files_selection_bias(model: Any, hf_dir: Path) -> None:
    """transformers' Qwen3-MoE has no selection bias and ignores the file's ``e_score_correction_bias``: its
    routers are given one that picks the top-k of ``probs + bias`` (weights from the unbiased probabilities),
    as ours does. The biases must have moved (the demo's bias update ran)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in hf_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    biased = 0
    for index, layer in enumerate(model.model.layers):
        bias = tensors.get(f"model.layers.{index}.mlp.gate.e_score_correction_bias")
        if bias is None:
            continue
        assert bias.abs().max() > 0, f"layer {index}: the selection bias never moved"
        gate = layer.mlp.gate

        def forward(hidden: torch.Tensor, gate=gate, bias=bias):  # type: ignore[no-untyped-def]
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            indices = torch.topk(probs + bias, gate.top_k, dim=-1).indices
            weights = probs.gather(-1, indices)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        gate.forward = forward
        biased += 1
    assert biased == 2  # layers 0 and 2


def _converts_without_config_and_transformers_reproduces_the_validation_loss(
    tmp_path: Path, val_loss: float
) -> None:
    """The strategy recorded the model's HF config at save time: ``convert dcp-to-hf`` needs no --config, and
    transformers, given the converted directory, computes the demo's final validation loss (its last checkpoint
    holds the same weights, after the last step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    checkpoint, out = tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "hf"
    command = [sys.executable, "-m", "lightning_d9d.convert", "dcp-to-hf", str(checkpoint), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    _route_with_the_files_selection_bias(model, out)
    example = _example_module()
    config = example.MODELS["tiny-moe"]()
    # the demo's held-out samples (30 steps of 16 sequences of 64 tokens; 4 batches of 8 on each of 2 ranks)
    val = example.SyntheticCorpus(config.vocab_size, 64, 64, first_sample=16 * 30)
    samples = [val[i] for i in range(len(val))]
    input_ids = torch.stack([s["input_ids"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    print(f"demo val/loss {val_loss:.4f}, transformers on the converted checkpoint {float(loss):.4f}")
    # val_loss is printed to 4 decimals (5e-5); without the selection bias transformers is 4e-4 off here
    assert abs(float(loss) - val_loss) < 2e-4


def test_the_demo_splits_its_batch_over_the_data_parallel_ranks() -> None:
    ranks = _example_module().data_parallel_ranks
    assert ranks(2, pp=1, dp_replicate=1, dp_shard=-1, tp=1) == 2
    assert ranks(4, pp=1, dp_replicate=2, dp_shard=-1, tp=1) == 4  # 2 replicas of 2 shards: 4 take rows
    assert ranks(8, pp=2, dp_replicate=2, dp_shard=-1, tp=1) == 4
    assert ranks(8, pp=1, dp_replicate=1, dp_shard=2, tp=2) == 2
