"""Pipeline parallelism on ``torch.distributed.pipelining``: schedules, stage carving, the runner, forward-only
runs. The Lightning-facing side (the closure that zeroes gradients first, ``backward``) is in ``strategies/``."""

from lightning_d9d.pipeline.carve import StageLayout, carve_stages, find_splittable
from lightning_d9d.pipeline.runner import PipelineRunner, check_microbatch_split
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
    "PipelineRunner",
    "PipelineSplittable",
    "StageLayout",
    "balanced_stage_layers",
    "build_schedule",
    "carve_stages",
    "check_microbatch_split",
    "check_pipeline_config",
    "find_splittable",
    "rank_of_stage",
    "resolve_schedule_name",
    "stages_of_rank",
]
