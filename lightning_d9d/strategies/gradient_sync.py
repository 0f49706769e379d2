"""Gradient reduction held back on the micro-steps of gradient accumulation: the last micro-step reduces the sum."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_d9d.pipeline import PipelineRunner


@contextmanager
def gradient_sync_held_back(
    model: nn.Module | None, runner: PipelineRunner | None
) -> Generator[None, None, None]:
    """No reduce-scatter / all-reduce inside: each FSDP unit of ``model`` keeps its unsharded gradients, or,
    under pp, the ``runner``'s stages hold back the reduction torch's schedule would make every step."""
    if runner is not None:
        runner.sync_gradients = False
        try:
            yield None
        finally:
            runner.sync_gradients = True
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if model else []
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield None
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
