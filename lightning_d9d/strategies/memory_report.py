"""The memory plan of this run, printed once on rank 0 at the first training step, with a warning when it exceeds
the device's memory. The strategy reports it at the first training ``model_loss``, before its forward, where the
token shape and how the LM head's loss runs (fused or through logits) are both known; a step that never calls
``model_loss`` gets it after its ``training_step``, with the logits head. The numbers come from
:mod:`lightning_d9d.plans.memory`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.pipeline import PipelineConfig
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.data_parallel import wraps_in_fsdp
from lightning_d9d.plans.memory import (
    ActivationShape,
    MemoryPlan,
    optimizer_states_per_parameter,
    plan_memory,
)
from lightning_d9d.strategies.optimizers import unwrap_optimizer


@dataclass(frozen=True)
class PlannedRun:
    """What the memory plan reads of a run: the strategy hands it over, the report never sees the strategy."""

    module: nn.Module  # the LightningModule: its parameters and its transformer's config
    optimizer: Optimizer | None  # the first one (its states per parameter); None before any exists
    device: torch.device
    dims: ParallelDims
    pipeline: PipelineConfig
    precision: str
    options: ParallelOptions  # as the plans apply them (activation checkpointing, resharding)


def token_batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(sequences, tokens per sequence)`` of the first 2-D integer tensor in ``batch`` (the input ids)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 2 and not torch.is_floating_point(batch):
            return int(batch.shape[0]), int(batch.shape[1])
        return None
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (Sequence, type({}.values()))) and not isinstance(values, str):
        for value in values:
            found = token_batch_shape(value)
            if found is not None:
                return found
    return None


def transformer_config(module: nn.Module) -> Any | None:
    """The config of the first submodule whose ``config`` names a ``hidden_size`` (our models, HF-style ones)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "hidden_size", None) is not None:
            return config
    return None


def _activation_shape(run: PlannedRun, batch: Any, config: Any, head_fused: bool) -> ActivationShape | None:
    shape = token_batch_shape(batch)
    layers = getattr(config, "num_hidden_layers", None)
    if shape is None or layers is None:
        return None
    dims, pipeline = run.dims, run.pipeline
    sequences, length = shape
    in_flight, head = 1, True
    if dims.pp > 1:
        sequences = max(1, sequences // pipeline.microbatches)
        stages = pipeline.num_stages(dims.pp)
        # GPipe keeps every microbatch alive; 1F1B-like schedules at most one per stage ahead of it
        in_flight = (
            pipeline.microbatches if pipeline.schedule == "GPipe" else min(pipeline.microbatches, stages)
        )
        head = dims.mesh_for("pp").get_local_rank() == (0 if pipeline.v_shape else dims.pp - 1)
    return ActivationShape(
        tokens=sequences * max(1, length // dims.cp),
        layers=math.ceil(int(layers) / dims.pp),
        in_flight=in_flight,
        dtype_bytes=2 if "16" in run.precision else 4,
        tp=dims.tp,
        head=head,
        head_fused=head_fused,
        # whole-block recompute; "selective" keeps the matmul outputs, counted as no recompute (an upper bound)
        recompute=run.options.activation_checkpointing in (True, "full"),
        expert_tensor_parallel=run.options.expert_tensor_parallel and dims.tp_enabled,
    )


def _checkpointing_name(setting: bool | str) -> str:
    if isinstance(setting, bool):
        return "on" if setting else "off"
    return setting  # "full" or "selective"


def report_memory_plan(
    run: PlannedRun, batch: Any, device_memory: int | None = None, *, head_fused: bool = False
) -> MemoryPlan:
    """Compute this rank's plan for ``batch`` (the model's inputs or the whole batch: its first 2-D integer
    tensor gives the token shape); rank 0 prints it and warns when it exceeds ``device_memory`` (bytes; by default
    what CUDA reports for the run's device, unknown on other devices). ``head_fused``: the LM head's loss
    runs fused (no ``[tokens, vocab]`` logits), which the head's activations are then counted for."""
    states = optimizer_states_per_parameter(unwrap_optimizer(run.optimizer)) if run.optimizer else 0
    config = transformer_config(run.module)
    if device_memory is None and run.device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(run.device).total_memory
    plan = plan_memory(
        run.module.parameters(),
        optimizer_states=states,
        config=config,
        activations=None if config is None else _activation_shape(run, batch, config, head_fused),
        device_memory=device_memory,
    )
    heading = (
        f"memory plan per rank ({run.dims}, precision {run.precision}, activation "
        f"checkpointing {_checkpointing_name(run.options.activation_checkpointing)}, LM head "
        f"{'fused with its loss' if head_fused else 'with logits'}):"
    )
    rank_zero_info(plan.describe(heading))
    if plan.exceeds_device:
        rank_zero_warn(
            f"the memory plan needs {plan.total / 2**30:.1f} GiB per rank, more than the device's "
            f"{(plan.device_memory or 0) / 2**30:.1f} GiB: raise dp_shard / tp / pp, turn on "
            "activation_checkpointing, or lower the batch size or sequence length" + _unsharded_fsdp_hint(run)
        )
    return plan


def _unsharded_fsdp_hint(run: PlannedRun) -> str:
    """The lever for FSDP units that shard over one rank and keep their gathered parameters to backward (the
    default there): the plan's activations do not count that bf16 copy of the blocks' weights."""
    dims, options = run.dims, run.options
    if dims.fsdp > 1 or not wraps_in_fsdp(dims, options) or options.reshards(dims.fsdp):
        return ""
    return (
        "; with dp_shard=1, reshard_after_forward=True also frees the bf16 copy of the blocks' weights that FSDP "
        "keeps from forward to backward (2 bytes per parameter; about 2 % slower on one GPU)"
    )
