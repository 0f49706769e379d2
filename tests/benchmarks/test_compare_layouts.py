"""benchmarks/compare_layouts.py: the two-GPU runs' loss guard. Each row of a layouts.jsonl is held to the
one-GPU row of the same impl, model, shape and steps; outside the band, a non-finite loss or a line that is not
a result fails; a CUDA-only run skipped on the CPU passes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compare_layouts import TOLERANCE, compare, main


def _row(layout: dict, gpus: int, loss: float, **extra: object) -> dict:
    return {
        "impl": "ours", "model": "0.6b", "seq_len": 4096, "global_batch": 4, "steps": 50, "layout": layout,
        "gpus": gpus, "tokens_per_s_per_gpu": 40000 if gpus == 1 else 38000, "tokens_per_s": 40000,
        "peak_mem_gib_max_rank": 60.0 / gpus, "last_loss": loss, "loss_last10_mean": loss, **extra,
    }  # fmt: skip


def test_rows_in_the_band_pass_and_outside_fail() -> None:
    one = _row({"one rank": 1}, 1, 7.0)
    inside = _row({"tp": 2}, 2, 7.0 * (1 + TOLERANCE / 2))
    outside = _row({"cp": 2}, 2, 7.0 * (1 + 2 * TOLERANCE), context_attention="all_gather")
    lines, ok = compare([one, inside], TOLERANCE)
    assert ok and any("tp=2" in line and line.endswith("ok") for line in lines)
    lines, ok = compare([one, inside, outside], TOLERANCE)
    assert not ok and any("cp=2" in line and "FAIL" in line for line in lines)
    _, ok = compare([one, _row({"pp": 2}, 2, math.nan)], TOLERANCE)
    assert not ok


def test_the_reference_is_the_one_gpu_row_of_the_same_group() -> None:
    one = _row({"one rank": 1}, 1, 7.0)
    hf_two = {
        **_row({"tp": 2}, 2, 9.0),
        "impl": "hf_trainer",
    }  # another impl: its own group, no verdict vs ours
    fp8 = _row({"dp_shard": 2}, 2, 7.05, fp8="tensorwise")
    lines, ok = compare([fp8, one, hf_two], TOLERANCE)
    assert ok, lines
    assert any(line.startswith("# ours") and "reference: ours 0.6b one rank=1" in line for line in lines)


def test_weak_scaling_rows_report_their_scaling_without_a_loss_verdict() -> None:
    one = _row({"one rank": 1}, 1, 7.0)
    two = {**_row({"dp_shard": 2}, 2, 6.0), "global_batch": 8, "tokens_per_s": 79000}
    lines, ok = compare([one, two], TOLERANCE)
    assert ok and any(line.startswith("scaling: 0.950x") for line in lines)


def test_skipped_runs_pass_and_broken_lines_fail(tmp_path: Path) -> None:
    path = tmp_path / "layouts.jsonl"
    one = json.dumps(_row({"one rank": 1}, 1, 7.0))
    skip = json.dumps({"skipped": "--async-tp: CUDA only", "impl": "ours", "model": "tiny"})
    path.write_text(f"{one}\n{skip}\n")
    assert main([str(path)]) == 0
    path.write_text(f"{one}\n{skip}\nTraceback (most recent call last):\n")
    assert main([str(path)]) == 1
