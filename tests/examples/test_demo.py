"""The README's first command runs: ``make demo`` is ``examples/pretrain_qwen3.py`` with its defaults (a tiny
Qwen3-MoE on 2 CPU processes); here a shortened run of it, launched as a user would."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_qwen3.py"


def test_the_demo_trains_the_moe_model_and_reports(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(EXAMPLE), "--max-steps", "30", "--output", str(tmp_path / "run")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    metrics = ast.literal_eval(done[len("done: ") : done.index("}") + 1])  # the dict the demo prints
    assert {"train/loss", "train/router_loss", "val/loss", "val/ppl", "perf/tokens_per_sec"} <= set(metrics)
    first = next(line for line in proc.stdout.splitlines() if line.startswith("step   10"))
    assert metrics["train/loss"] < float(first.split()[3]) < 5.6  # it trains: ln(256) = 5.55 at the start
    assert "dp_shard=2" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
