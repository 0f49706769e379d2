"""benchmarks/layouts.py's transformers baseline runs on two gloo processes (the two-GPU runs use it: a broken
script would cost a run on scarce GPUs to find out). Its Trainer side is the example module that the
strategy tests run on every layout; one launch of it here would double this file's time in CI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from distributed import run_launched

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "layouts.py"


def test_the_baseline_trains_on_two_processes(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
        "--impl", "hf", "--device", "cpu", "--model", "tiny", "--seq-len", "32", "--global-batch", "4",
        "--steps", "3", "--warmup", "1",
    ]  # fmt: skip
    done = run_launched(command, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["impl"] == "hf_fsdp_compiled"
    assert report["layout"] == {"dp_shard": 2} and report["gpus"] == 2
    assert math.isfinite(report["last_loss"]) and report["tokens_per_s"] > 0


def test_the_baseline_refuses_layouts_it_does_not_have() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--impl", "hf", "--tp", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--impl hf shards data only" in done.stderr and "'tp': 2" in done.stderr


def test_cuda_only_runs_print_a_skip_line_on_the_cpu() -> None:
    for flags in (["--tp", "2", "--async-tp"], ["--cp", "2", "--context-attention", "torch_ring"]):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--device", "cpu", "--model", "tiny", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "CUDA only" in json.loads(done.stdout.strip().splitlines()[-1])["skipped"]
