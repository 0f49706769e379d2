"""Pipeline parallelism on ``torch.distributed.pipelining``: schedules, stage split, forward-only runs."""

from lightning_d9d.pipeline.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    PipelineConfig,
    build_schedule,
    check_pipeline_config,
    resolve_schedule_name,
)
from lightning_d9d.pipeline.split import balanced_stage_layers, rank_of_stage, stages_of_rank
from lightning_d9d.pipeline.traits import PipelineSplittable

__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "PipelineConfig",
    "PipelineSplittable",
    "balanced_stage_layers",
    "build_schedule",
    "check_pipeline_config",
    "rank_of_stage",
    "resolve_schedule_name",
    "stages_of_rank",
]
