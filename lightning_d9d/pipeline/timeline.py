"""Draw a pipeline schedule: ranks × time, one block per forward / backward / weight-gradient action.

The actions come from torch itself (the order its schedule classes execute), so the picture shows what
``D9DStrategy(pp=..., pipeline_schedule=...)`` runs. Drawing needs matplotlib: ``pip install lightning-d9d[plot]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_d9d.compat import pipeline_action_types, schedule_ops
from lightning_d9d.pipeline.schedules import check_pipeline_config

# computation type -> (legend label, colour)
_STYLE = {
    "F": ("forward", "#4C78A8"),
    "B": ("backward", "#54A24B"),
    "I": ("backward, input grads", "#F58518"),
    "W": ("backward, weight grads", "#B279A2"),
    "OVERLAP_F_B": ("forward + backward overlapped", "#9D755D"),
}


@dataclass(frozen=True)
class TimelineBlock:
    rank: int
    start: float
    length: float
    kind: str  # a key of _STYLE
    label: str  # "stage:microbatch", or "Fs:m|Bs:m" for overlapped pairs


# Durations of the compute actions in "forward passes of the whole model's share of one rank" (a full
# backward is about twice a forward); divided by the stages per rank, since each stage then has fewer layers.
_DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


def _duration(action: Any, stages_per_rank: int) -> float:
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return sum(_duration(sub, stages_per_rank) for sub in action.sub_actions or ())
    return _DURATION[kind] / stages_per_rank


def _needs(action: Any, num_stages: int) -> list[tuple[str, int, int]]:
    """What must have finished before ``action`` can start: ("F"|"G"|"I", stage, microbatch)."""
    kind, stage, mb = action.computation_type.value, action.stage_index, action.microbatch_index
    if kind == "OVERLAP_F_B":
        return [need for sub in action.sub_actions or () for need in _needs(sub, num_stages)]
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):  # the gradient of this stage's output, from the next stage (or the loss)
        return [("G", stage + 1, mb)] if stage < num_stages - 1 else [("F", stage, mb)]
    return [("I", stage, mb)]  # W after this stage's input gradients


def _produces(action: Any) -> list[tuple[str, int, int]]:
    kind, stage, mb = action.computation_type.value, action.stage_index, action.microbatch_index
    if kind == "OVERLAP_F_B":
        return [made for sub in action.sub_actions or () for made in _produces(sub)]
    return {"F": [("F", stage, mb)], "B": [("G", stage, mb)], "I": [("G", stage, mb), ("I", stage, mb)]}.get(
        kind, []
    )


def _single_stage_order(schedule: str, pp: int, microbatches: int) -> list[list[Any]]:
    """GPipe and 1F1B orders (torch 2.13's visual order for its single-stage schedules is off by one)."""
    Action, ComputationType = pipeline_action_types()

    orders = []
    for rank in range(pp):
        forward = [Action(rank, ComputationType.FORWARD, mb) for mb in range(microbatches)]
        backward = [Action(rank, ComputationType.FULL_BACKWARD, mb) for mb in range(microbatches)]
        if schedule == "GPipe":
            orders.append(forward + backward)
            continue
        warmup = min(pp - rank - 1, microbatches)  # 1F1B: fill, then one forward per backward, then drain
        order = forward[:warmup]
        for mb in range(warmup, microbatches):
            order += [forward[mb], backward[mb - warmup]]
        orders.append(order + backward[microbatches - warmup :])
    return orders


def schedule_timeline(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int | None = None
) -> list[TimelineBlock]:
    """The blocks of one training step of ``schedule``: torch's per-rank action order, placed in time by
    simulating it (each action starts when its rank is free and its inputs exist)."""
    config = check_pipeline_config(pp, schedule, microbatches, stages_per_rank)
    if config.stages_per_rank == 1:
        ops = _single_stage_order(config.schedule, pp, microbatches)
    else:
        ops = schedule_ops(config.schedule, pp, microbatches, config.stages_per_rank)
    queues = [
        [a for a in row if a is not None and (a.computation_type.value in _DURATION or a.sub_actions)]
        for row in ops
    ]
    num_stages = config.num_stages(pp)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    blocks: list[TimelineBlock] = []
    while any(queues):
        progressed = False
        for rank, queue in enumerate(queues):
            while queue and all(need in done for need in _needs(queue[0], num_stages)):
                action = queue.pop(0)
                start = max([free[rank], *(done[n] for n in _needs(action, num_stages))])
                length = _duration(action, config.stages_per_rank)
                free[rank] = start + length
                for made in _produces(action):
                    done[made] = start + length
                kind = action.computation_type.value
                if kind == "OVERLAP_F_B":
                    label = "|".join(
                        f"{a.computation_type.value}{a.stage_index}:{a.microbatch_index}"
                        for a in action.sub_actions
                    )
                else:
                    label = f"{action.stage_index}:{action.microbatch_index}"
                blocks.append(TimelineBlock(rank, start, length, kind, label))
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"{schedule}: the action order cannot be placed in time (a dependency is missing)"
            )
    return blocks


def draw_schedule(
    schedule: str, pp: int, microbatches: int, path: str | Path, stages_per_rank: int | None = None
) -> Path:
    """Write a PNG of one step of ``schedule``; block labels are ``stage:microbatch``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # optional dependency
        raise ImportError("draw_schedule needs matplotlib: pip install 'lightning-d9d[plot]'") from error
    blocks = schedule_timeline(schedule, pp, microbatches, stages_per_rank)
    width = max(block.start + block.length for block in blocks)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.32 * width), 0.6 * pp + 1.2))
    for block in blocks:
        _, colour = _STYLE.get(block.kind, (block.kind, "#999999"))
        axes.broken_barh(
            [(block.start, block.length)], (block.rank - 0.4, 0.8), facecolors=colour, edgecolor="white"
        )
        axes.text(
            block.start + block.length / 2,
            block.rank,
            block.label,
            ha="center",
            va="center",
            fontsize=6,
            color="white",
        )
    axes.set_yticks(range(pp), [f"rank {rank}" for rank in range(pp)])
    axes.invert_yaxis()
    axes.set_xlim(0, width)
    axes.set_xlabel("time (one unit = a forward pass of one rank's layers; backward = 2 units)")
    axes.set_title(f"{schedule}: pp={pp}, {microbatches} microbatches (labels: stage:microbatch)", fontsize=9)
    kinds = sorted({block.kind for block in blocks}, key=list(_STYLE).index)
    axes.legend(
        handles=[Patch(color=_STYLE[k][1], label=_STYLE[k][0]) for k in kinds],
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if pp < 4 else -0.2),
        ncol=len(kinds),
        frameon=False,
    )
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
