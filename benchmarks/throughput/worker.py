"""A path's worker, the process ``train_throughput.py --worker <path>`` runs: the path on its loop (the Trainer
paths on ``trainer_loop``, the others on ``plain_loop``; ``matmul_peak``: the bf16 matmul ceiling), peak memory and
the GPU's name, or the error that stopped it (reported in the table; the other paths still run)."""

from __future__ import annotations

import argparse
import statistics
import traceback
from typing import Any

from .plain_loop import run_plain_loop
from .trainer_loop import run_trainer


def run_matmul_peak(args: argparse.Namespace) -> dict[str, Any]:
    """The bf16 matmul rate this GPU reaches on random data (a ceiling for MFU, next to the datasheet's)."""
    import torch

    n = 8192
    sets = [
        (
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for i in range(10):
        torch.mm(*sets[i % 2], out=out)
    torch.cuda.synchronize()
    times = []
    for i in range(40):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(*sets[i % 2], out=out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return {"matmul_n": n, "matmul_ms": ms, "matmul_tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def worker(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {"path": path}
    try:
        if path == "matmul_peak":
            result.update(run_matmul_peak(args))
        elif path.startswith(("ours_trainer", "hf_trainer")):
            result.update(run_trainer(path, args))
        else:
            result.update(run_plain_loop(path, args))
        if args.device == "cuda":
            result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["gpu_name"] = torch.cuda.get_device_name(0)
        result["ok"] = True
    except Exception as error:  # reported in the table; the other paths still run
        traceback.print_exc()
        result["ok"] = False
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
    return result
