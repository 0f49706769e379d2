"""The plot's bars (benchmarks/plot.py): tokens/s at each path's median step, failed paths left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plot import load


def test_bars_are_tokens_per_second_at_the_median_step(tmp_path: Path) -> None:
    run = {
        "meta": {"tokens_per_step": 16384},
        "results": [
            # a window with one slow step: its mean-based tokens/s is lower than the median's
            {"path": "hf_fsdp_compiled", "ok": True, "tokens_per_s": 60000.0, "step_ms": {"median": 200.0}},
            {
                "path": "ours_trainer_compiled",
                "ok": True,
                "tokens_per_s": 90000.0,
                "step_ms": {"median": 160.0},
            },
            {"path": "ours_trainer_compiled_full", "ok": False, "error": "timeout"},
        ],
    }
    path = tmp_path / "train_throughput.json"
    path.write_text(json.dumps(run))
    title, results = load(f"dense={path}")
    assert title == "dense"
    assert [r["path"] for r in results] == ["hf_fsdp_compiled", "ours_trainer_compiled"]
    assert [r["median_tokens_per_s"] for r in results] == [16384 * 1e3 / 200.0, 16384 * 1e3 / 160.0]
