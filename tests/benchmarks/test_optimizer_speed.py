"""benchmarks/optimizer_speed.py, the optimizers' benchmark of one GPU: its worker trains through the Trainer with
each optimizer on the CPU (a broken run would otherwise show only on a GPU), the guard holds AdamW's math to
adamw's loss, and ``--largest`` moves to the next shape where a run runs out of memory, and only there."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import optimizer_speed as bench
import train_throughput as tt

OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB"
CPU = ["--device=cpu", "--seq-len=16", "--batch-size=2", "--warmup=1", "--steps=2", "--lr=1e-3"]


def test_each_optimizer_trains_through_the_worker_on_the_cpu() -> None:
    """Blocks eager (``--no-compile``); the master-weight run with every block recomputed (``--largest``'s way).
    The same weights and batches: the first step's loss is one value, AdamW's math lands near adamw's."""
    args = tt.parse_args([*CPU, "--model=tiny"])
    results = {}
    for name in ("adamw", "stochastic_master", "muon"):
        results[name] = bench.worker(name, args, recompute=name == "stochastic_master", compile_blocks=False)
        if dist.is_initialized():
            dist.destroy_process_group()
    for name, result in results.items():
        assert result["ok"], (name, result.get("error"))
        assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"]), name
    assert results["stochastic_master"]["precision"] == "bf16-true"
    assert results["stochastic_master"]["activation_checkpointing"] == "full"
    assert results["stochastic_master"]["stochastic_step"] == "torch"  # CPU tensors: the torch step
    assert "Muon" in results["muon"]["optimizer_repr"]
    assert len({r["losses"][0] for r in results.values()}) == 1
    bench.check_losses([bench.derive(r, args, 1) for r in results.values()])
    assert results["stochastic_master"]["loss_ok"], results["stochastic_master"]["loss_vs_adamw"]


def _result(name: str, model: str, final_loss: float = 10.0, **extra: Any) -> dict[str, Any]:
    return {
        "optimizer": name,
        "ok": True,
        "elapsed_s": 2.0,
        "step_ms": tt._summary([100.0]),
        "optimizer_ms": tt._summary([5.0]),
        "peak_mem_gib": 40.0,
        "losses": [11.9, final_loss],
        **extra,
    }


def fake_gpu(
    fits: dict[str, set[str]], losses: dict[str, float] | None = None
) -> tuple[bench.RunOne, list[Any]]:
    """A GPU on which each optimizer fits only the shapes ``fits`` names for it."""
    calls: list[Any] = []

    def run(job: int, name: str, args: argparse.Namespace, recompute: bool, logdir: Path) -> dict[str, Any]:
        calls.append((args.model, name, recompute))
        if args.model not in fits.get(name, {args.model}):
            return {"optimizer": name, "ok": False, "error": OOM}
        return _result(name, args.model, (losses or {}).get(name, 10.0))

    return run, calls


def test_largest_moves_to_the_next_shape_on_out_of_memory_and_stops_at_the_first_fit(tmp_path: Path) -> None:
    run, calls = fake_gpu({"adamw": {"1.7b", "0.6b"}, "stochastic": {"4b", "1.7b"}, "plain": set()})
    shapes = ["8b", "4b", "1.7b"]
    results = bench.run_largest(
        shapes, ["adamw", "stochastic", "plain"], ["--device=cpu"], tmp_path, run, True
    )
    assert calls == [
        ("8b", "adamw", True),
        ("4b", "adamw", True),
        ("1.7b", "adamw", True),
        ("8b", "stochastic", True),
        ("4b", "stochastic", True),
        *((shape, "plain", True) for shape in shapes),
    ]
    assert bench.failed(results, largest=True) == []  # running out of memory is the measurement
    table = (tmp_path / "optimizer_largest.md").read_text()
    assert "| adamw | 1.7b |" in table and "| stochastic | 4b |" in table
    assert "| plain | none of those tried |" in table
    assert "8b: out of memory, 4b: fits" in table


def test_a_run_that_fails_otherwise_fails_the_largest_search(tmp_path: Path) -> None:
    def broken(
        job: int, name: str, args: argparse.Namespace, recompute: bool, logdir: Path
    ) -> dict[str, Any]:
        return {"optimizer": name, "ok": False, "error": "RuntimeError: shapes do not match"}

    results = bench.run_largest(["8b", "4b"], ["muon"], ["--device=cpu"], tmp_path, broken, True)
    assert [r["model"] for r in results] == ["8b"]  # not an answer about memory: no smaller shape tried
    assert bench.failed(results, largest=True) == ["8b muon: RuntimeError: shapes do not match"]


def test_the_guard_holds_adamws_math_to_adamws_loss(tmp_path: Path) -> None:
    """stochastic 3 % from adamw fails; muon 5 % from it is a measurement, and so is plain's other start."""
    losses = {"adamw": 10.0, "stochastic": 10.3, "stochastic_master": 10.1, "muon": 10.5, "plain": 9.0}
    run, _ = fake_gpu({}, losses)
    results = bench.run_speed(["0.6b"], list(losses), ["--device=cpu"], tmp_path, run, True)
    assert bench.failed(results, largest=False) == ["0.6b stochastic: final loss outside the guard"]
    assert results[1]["loss_vs_adamw"] == pytest.approx(0.03)
    assert "plain" not in [r["optimizer"] for r in results if "loss_vs_adamw" in r]
    table = (tmp_path / "optimizer_speed.md").read_text()
    assert "| 0.6b | stochastic_master | 100.0 | 5.00 |" in table
    assert (tmp_path / "optimizer_speed.json").is_file()
