"""Where a d9d strategy tells cudagraph trees that a new step begins (``compile="reduce-overhead"`` on CUDA)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.plans.compile import compile_mode, uses_cudagraphs
from lightning_d9d.strategies.accumulation import current_micro_step


def may_record_cuda_graphs(device: torch.device, compile: bool | str) -> bool:
    """A CUDA-graph compile mode on CUDA (the plan may still fall back: marking a step then changes nothing)."""
    return device.type == "cuda" and uses_cudagraphs(compile_mode(compile))


def mark_step(device: torch.device, compile: bool | str) -> None:
    """Tell cudagraph trees that a new step begins, where the blocks may run as CUDA graphs.

    cudagraph trees reuse a step's graph memory only once they know the step is over: at a new "generation"
    (``CUDAGraphTreeManager.can_start_new_generation``), which without this call comes only when no forward
    waits for its backward; otherwise the next forward records behind the previous step's still-live
    outputs, or reading one of them fails ("accessing tensor output of CUDAGraphs that has been overwritten").
    Marking where no block records graphs (the plan fell back, or the device is not CUDA) changes nothing."""
    if may_record_cuda_graphs(device, compile):
        torch.compiler.cudagraph_mark_step_begin()


def training_step_marks(module: Any) -> bool:
    """Whether a training step of ``module`` marks a new step: only where it opens a window of gradient
    accumulation (every step without accumulation, and under manual optimization). The gradients of the window's
    earlier micro-steps may live in the graphs' memory (the backward's outputs that autograd keeps as ``.grad``),
    which a new generation would hand out again; the window's opening comes after the zero-grad-first closure
    (used in every fit: ``D9DStrategy.setup``) set them to ``None``."""
    step = current_micro_step(module)
    return step is None or step.opens_window
