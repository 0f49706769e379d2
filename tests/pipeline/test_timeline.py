from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest

from lightning_d9d.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from lightning_d9d.pipeline.timeline import draw_schedule, schedule_timeline

SCHEDULES = list(PIPELINE_SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_stage_runs_every_microbatch_forward_then_backward(schedule: str) -> None:
    pp, microbatches = 4, 8
    blocks = schedule_timeline(schedule, pp, microbatches)
    forwards: dict[str, float] = {}
    backwards: dict[str, float] = {}
    for block in blocks:
        for part in block.label.split("|"):
            kind, key = (part[0], part[1:]) if block.kind == "OVERLAP_F_B" else (block.kind, part)
            (forwards if kind == "F" else backwards).setdefault(key, block.start)
    stages = 4 if schedule in ("GPipe", "1F1B") else 8
    assert len(forwards) == len(backwards) == stages * microbatches
    assert all(forwards[key] < backwards[key] for key in forwards)
    # no rank runs two blocks at once
    for rank in range(pp):
        spans = sorted((b.start, b.start + b.length) for b in blocks if b.rank == rank)
        assert all(end <= next_start + 1e-9 for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert Counter(b.rank for b in blocks).keys() == set(range(pp))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_single_stage_schedules_take_the_textbook_time(schedule: str) -> None:
    # (microbatches + pp - 1) * (forward + backward) with backward = 2 forwards
    blocks = schedule_timeline(schedule, 4, 8)
    assert max(b.start + b.length for b in blocks) == (8 + 4 - 1) * 3


def test_interleaving_and_zero_bubble_shrink_the_bubble() -> None:
    def makespan(schedule: str) -> float:
        return max(b.start + b.length for b in schedule_timeline(schedule, 4, 8))

    assert makespan("ZBVZeroBubble") < makespan("Interleaved1F1B") < makespan("1F1B")


def test_draws_a_png(tmp_path: Path) -> None:
    path = draw_schedule("DualPipeV", 2, 4, tmp_path / "dualpipev.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
