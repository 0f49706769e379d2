"""The pipeline schedules of ``torch.distributed.pipelining`` that the strategy accepts, and their rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

# Every torch schedule is one of the two (both derive from torch's private ``_PipelineSchedule``).
PipelineSchedule: TypeAlias = PipelineScheduleSingle | PipelineScheduleMulti

# name -> (stages per rank: fixed number or None for "any, default 2", V-shaped placement)
SCHEDULES: dict[str, tuple[int | None, bool]] = {
    "GPipe": (1, False),
    "1F1B": (1, False),
    "Interleaved1F1B": (None, False),
    "LoopedBFS": (None, False),
    "InterleavedZeroBubble": (None, False),
    "ZBVZeroBubble": (2, True),
    "DualPipeV": (2, True),
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


# Schedules that split backward into an input-gradient and a later weight-gradient pass. FSDP must keep
# their parameters unsharded from forward to backward (reshard_after_forward=False): when it frees and
# re-gathers them in between, the weight pass gives wrong gradients (torch 2.13, measured 5e-4 off in the
# loss after one step with dp=2; exact with the parameters kept).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline configuration (checked before any process group exists).

    The number of pipeline ranks is not part of it: ``pp`` lives in :class:`~lightning_d9d.mesh.ParallelDims`
    alone, and whatever needs the stage count asks ``num_stages(pp)``.
    """

    schedule: str
    microbatches: int
    stages_per_rank: int

    def num_stages(self, pp: int) -> int:
        return pp * self.stages_per_rank

    @property
    def v_shape(self) -> bool:
        return SCHEDULES[self.schedule][1]


def check_pipeline_config(
    pp: int, schedule: str, microbatches: int | None, stages_per_rank: int | None
) -> PipelineConfig:
    name = resolve_schedule_name(schedule)
    fixed, _ = SCHEDULES[name]
    if stages_per_rank is None:
        stages_per_rank = fixed if fixed is not None else (2 if pp > 1 else 1)
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank ({stages_per_rank}) must be positive")
    if fixed is not None and stages_per_rank != fixed:
        raise ValueError(
            f"pipeline_schedule={name!r} needs stages_per_rank={fixed}, got {stages_per_rank}"
            + ("; use Interleaved1F1B or LoopedBFS for several stages per rank" if fixed == 1 else "")
        )
    num_stages = pp * stages_per_rank
    if microbatches is None:
        microbatches = num_stages
    if microbatches < 1:
        raise ValueError(f"microbatches ({microbatches}) must be positive")
    if pp > 1 and microbatches < num_stages:
        raise ValueError(
            f"microbatches ({microbatches}) must be at least the number of stages pp*stages_per_rank "
            f"({pp}*{stages_per_rank} = {num_stages}), or the pipeline never fills; raise microbatches"
        )
    if pp > 1 and name in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % pp:
        raise ValueError(f"{name} needs microbatches ({microbatches}) to be a multiple of pp ({pp})")
    return PipelineConfig(schedule=name, microbatches=microbatches, stages_per_rank=stages_per_rank)


def build_schedule(
    config: PipelineConfig,
    stages: Sequence[PipelineStage],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineSchedule:
    """The torch schedule over this rank's stages. ``scale_grads=False``: the loss is scaled instead, because
    the schedule would otherwise divide the whole accumulated ``.grad`` after every step, which breaks
    gradient accumulation across steps."""
    schedule_class = get_schedule_class(config.schedule)
    if issubclass(schedule_class, PipelineScheduleSingle):
        (stage,) = stages
        return schedule_class(stage, config.microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(list(stages), config.microbatches, loss_fn=loss_fn, scale_grads=False)
