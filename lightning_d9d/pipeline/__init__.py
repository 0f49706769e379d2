"""Pipeline parallelism on ``torch.distributed.pipelining``: schedules, stage split, microbatches."""

from lightning_d9d.pipeline.schedules import SCHEDULES, resolve_schedule_name

__all__ = ["SCHEDULES", "resolve_schedule_name"]
