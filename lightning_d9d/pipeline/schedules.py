"""Names of the pipeline schedules of ``torch.distributed.pipelining`` that the strategy accepts."""

from __future__ import annotations

# name -> stages per rank the schedule needs (None: any number; "V" schedules need exactly two).
SCHEDULES: dict[str, int | None] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": None,
    "LoopedBFS": None,
    "InterleavedZeroBubble": None,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}


def resolve_schedule_name(name: str) -> str:
    """Return the canonical spelling of a schedule name (case-insensitive), or raise naming the choices."""
    if not isinstance(name, str):
        raise TypeError(f"pipeline_schedule must be a string, got {name!r}")
    by_lower = {known.lower(): known for known in SCHEDULES}
    canonical = by_lower.get(name.lower())
    if canonical is None:
        raise ValueError(f"unknown pipeline_schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return canonical
