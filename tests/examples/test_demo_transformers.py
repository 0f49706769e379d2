"""``examples/pretrain_qwen3.py --model hf-qwen3`` (``hf-qwen3-moe``): the demo's pretraining on ``transformers``'
own Qwen3 (Qwen3-MoE) of the shape of ``--model tiny`` (``tiny-moe``), through the strategy's transformers adapter,
on 2 CPU processes (FSDP over both); and the demo needs ``transformers`` (an optional dependency) only there."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_qwen3.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.parametrize(
    ("model", "class_path"),
    [
        ("hf-qwen3", "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"),
        ("hf-qwen3-moe", "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM"),
    ],
)
def test_the_demo_trains_a_transformers_model(tmp_path: Path, model: str, class_path: str) -> None:
    command = [sys.executable, str(EXAMPLE), "--model", model, "--max-steps", "12"]
    command += ["--batch-size", "8", "--output", str(tmp_path / "run")]
    proc = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    metrics = ast.literal_eval(done[len("done: ") : done.index("}") + 1])  # the dict the demo prints
    assert {"train/loss", "val/loss", "val/ppl"} <= set(metrics)
    assert ("train/router_loss" in metrics) is model.endswith("moe")  # transformers' load-balancing loss
    assert all(math.isfinite(value) for value in metrics.values())
    first = next(line for line in proc.stdout.splitlines() if line.startswith("step   10"))
    assert metrics["train/loss"] < float(first.split()[3]) < 5.6  # it trains: ln(256) = 5.55 at the start
    assert "dp_shard=2" in proc.stdout  # data parallel over the 2 processes
    assert f"model: {class_path}" in proc.stdout  # transformers' own class, through the adapter
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "meta.pt").is_file()  # DCP saved it


def _imports_transformers(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "transformers" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers"


def test_the_demo_imports_transformers_only_for_its_models() -> None:
    """``transformers`` is optional: the demo's source imports it only where it builds transformers' model, once
    ``--model hf-*`` asked for it (a runtime check cannot tell: where transformers is installed, ``import
    lightning`` loads it through torchmetrics)."""
    tree = ast.parse(EXAMPLE.read_text())
    inside = [
        f"{owner.name}.{function.name}"
        for owner in ast.walk(tree)
        if isinstance(owner, ast.ClassDef)
        for function in owner.body
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if _imports_transformers(node)
    ]
    assert inside == ["TransformersPretraining.configure_model"]
    assert sum(_imports_transformers(node) for node in ast.walk(tree)) == 1  # and nowhere else
