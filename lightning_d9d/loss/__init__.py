"""The loss layer: what a training step does with a forward's loss, shared by the Trainer's and Fabric's strategies.

It sits below ``strategies/`` and ``fabric/`` and above ``models/`` and ``pipeline/``: a loss walks down once,
strategy -> :func:`compute_loss` -> (the pipeline runner) -> the model's head -> the kernel.

- :mod:`~lightning_d9d.loss.step`: :func:`compute_loss`, the one path of both strategies' ``model_loss``, and the
  hand-off to the pipeline runner;
- :mod:`~lightning_d9d.loss.weights`: token weighting over ranks, microbatches and accumulation micro-steps;
- :mod:`~lightning_d9d.loss.head`: the fused-head choice (a model only declares its head:
  :class:`~lightning_d9d.modules.head.FusedHead`);
- :mod:`~lightning_d9d.loss.forward`: the loss without a pipeline, the cp split and vocabulary-parallel
  cross-entropy.
"""

from lightning_d9d.loss.forward import context_split, forward_loss, vocab_parallel
from lightning_d9d.loss.head import (
    FUSED_LOSS_ENV,
    declared_head,
    fused_causal_lm_loss,
    fused_ignore_index,
    fuses_head,
)
from lightning_d9d.loss.step import LossContext, compute_loss, pipeline_inputs, stage_inputs
from lightning_d9d.loss.weights import (
    TokenWindow,
    global_count,
    item_scale,
    micro_step_gradient,
    scale_internal_losses,
    weighed,
)

__all__ = [
    "FUSED_LOSS_ENV",
    "LossContext",
    "TokenWindow",
    "compute_loss",
    "context_split",
    "declared_head",
    "forward_loss",
    "fused_causal_lm_loss",
    "fused_ignore_index",
    "fuses_head",
    "global_count",
    "item_scale",
    "micro_step_gradient",
    "pipeline_inputs",
    "scale_internal_losses",
    "stage_inputs",
    "vocab_parallel",
    "weighed",
]
