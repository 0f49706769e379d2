"""The throughput benchmark's correctness guard (benchmarks/train_throughput.py): a path whose loss after the
timed steps is not finite or not within 2% of the baseline's is marked and fails the run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_throughput import LOSS_TOLERANCE, check_losses


def _run(path: str, final: float) -> dict:
    return {"path": path, "ok": True, "losses": [11.9, 9.0, final]}


def test_guard_marks_paths_outside_the_band_and_non_finite_losses() -> None:
    results = [
        _run("hf_fsdp_compiled", 7.50),
        _run("ours_trainer_compiled", 7.50 * (1 + LOSS_TOLERANCE / 2)),
        _run("ours_trainer_compiled_selective", 7.50 * (1 + 2 * LOSS_TOLERANCE)),  # trained too little
        _run("ours_trainer_compiled_nofsdp", math.nan),
        {"path": "ours_trainer", "ok": False, "error": "failed"},
    ]
    check_losses(results)
    assert [r.get("loss_ok") for r in results] == [True, True, False, False, None]
    assert math.isclose(results[1]["loss_vs_baseline"], LOSS_TOLERANCE / 2)


def test_without_a_baseline_only_finiteness_is_checked() -> None:
    results = [_run("ours_trainer_compiled", 7.5), _run("ours_eager", math.inf)]
    check_losses(results)
    assert [r["loss_ok"] for r in results] == [True, False]
