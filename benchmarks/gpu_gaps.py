"""Where the GPU waits inside a profiled window: busy time, idle time and the longest gaps between kernels.

A step can be longer than the sum of its kernels when the GPU runs out of queued work (the host launches
slower than the GPU retires, or the host waits on the GPU). ``torch.profiler``'s kernel table shows only the
busy part; this reads the device events' intervals, merges overlaps (streams run concurrently) and reports
what is left between them, with the kernels on either side of the longest gaps.
"""

from __future__ import annotations

from typing import Any


def device_intervals(profile: Any) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every device event (kernels, copies, fills) of a finished profile."""
    from torch.autograd import DeviceType

    intervals = []
    for event in profile.events():
        # record_function ranges also appear on the device's timeline (``gpu_user_annotation``, spanning the
        # kernels they launched): they are not work, and counted as such would hide the gaps they span
        if getattr(event, "is_user_annotation", False):
            continue
        if event.device_type == DeviceType.CUDA and event.time_range.end > event.time_range.start:
            intervals.append((float(event.time_range.start), float(event.time_range.end), event.name))
    return sorted(intervals)


def gap_summary(intervals: list[tuple[float, float, str]], steps: int, top: int = 12) -> str:
    """Busy and idle device time per step over the window the intervals span, and the ``top`` longest gaps."""
    if not intervals:
        return "no device events\n"
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    run_start, run_end, last_name = intervals[0][0], intervals[0][1], intervals[0][2]
    for start, end, name in intervals[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start = start
        if end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = run_end - intervals[0][0]
    lines = [
        f"device window {span / 1e3 / steps:.2f} ms/step: busy {busy / 1e3 / steps:.2f}, "
        f"idle {(span - busy) / 1e3 / steps:.2f} ms/step ({len(gaps)} gaps; "
        f"{sum(1 for g in gaps if g[0] >= 50)} of 50 us or more, "
        f"{sum(g[0] for g in gaps if g[0] >= 50) / 1e3 / steps:.2f} ms/step in them)",
        "longest gaps (us, the kernel before -> the kernel after):",
    ]
    for length, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {length:9.1f}  {before[:60]} -> {after[:60]}")
    return "\n".join(lines) + "\n"


def profile_report(profile: Any, steps: int, rows: int) -> str:
    """Where the GPU waited (:func:`gap_summary`), then ``rows`` of the kernel table by device time."""
    averages = profile.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)
    except (AttributeError, KeyError, ValueError):  # older torch names it after CUDA
        table = averages.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    return gap_summary(device_intervals(profile), steps) + table
