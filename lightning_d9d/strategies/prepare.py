"""A user's module made parallel on the mesh: what the Trainer's and Fabric's strategies do alike before training.

The order matters and is the same under both: refuse FSDP1 wrappers, add low-rank adapters where asked (``adapt``),
give every rank rank 0's eagerly initialised tensors, apply the plans (the module's own ``parallelize``, a
``transformers`` model's, or FSDP per repeated block), then give meta tensors their memory and initialise them
from one seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import hf_plan_for
from lightning_d9d.plans import Parallelizable, ParallelOptions, SeededInit, parallelize_default
from lightning_d9d.plans.lora import adapted_layers, adapter_on_meta, adapters, apply_lora, init_adapters_
from lightning_d9d.strategies.materialize import initialise_transformers_model, to_empty_except_metrics


def refuse_fsdp1(module: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
        raise TypeError(
            "found modules wrapped in FSDP1 (FullyShardedDataParallel); the d9d strategy applies FSDP2 "
            "itself: remove the wrapper"
        )


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def already_parallel(module: nn.Module) -> bool:
    """The user parallelized it already (Lightning's documented ModelParallelStrategy way)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def adapt(module: nn.Module, options: ParallelOptions) -> None:
    """The plans that change what a module *is* before any other plan runs: LoRA's adapters (``options.lora``),
    once (a module adapted by an earlier fit keeps its adapters)."""
    if options.lora is not None and not adapted_layers(module) and not already_parallel(module):
        apply_lora(module, options.lora, seed=torch.initial_seed())


def broadcast_plain_tensors(module: nn.Module, device: torch.device, world_size: int) -> None:
    """Give every rank rank 0's values for modules initialised eagerly (as DDP does), so that replicas and
    shards come from one initialisation even when ranks were seeded differently."""
    if world_size == 1:
        return
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_meta or isinstance(tensor, DTensor):
            continue
        moved = tensor.detach().to(device)
        dist.broadcast(moved, src=0)
        tensor.data = moved


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    stages: dict[int, nn.Module] | None = None,
) -> None:
    """Apply the plans: a ``Parallelizable`` module applies its own; otherwise each child with parameters gets
    its own plan, a ``transformers`` model's (``hf_plan_for``), or FSDP per repeated block. ``stages``: the
    pipeline stages this rank holds, each its own FSDP root (the schedule calls the stages, never the model)."""
    if stages is not None:
        for stage in stages.values():
            if isinstance(stage, Parallelizable):
                stage.parallelize(dims, options)
            else:
                parallelize_default(stage, dims, options, pipeline_stage=True)
        # the pipelined model is sharded now; other children (say, a loss head) go on below
    elif isinstance(module, Parallelizable):
        module.parallelize(dims, options)
        return
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters directly ({', '.join(own[:5])}); the d9d strategy "
            "shards submodules, so put them into a submodule (for example an nn.Module attribute)"
        )
    for child in module.children():
        if not any(True for _ in child.parameters()) or already_parallel(child):
            continue
        if isinstance(child, Parallelizable):
            child.parallelize(dims, options)
        elif (plan := hf_plan_for(child)) is not None:  # a transformers model: the plans its config ships
            plan(dims, options)
        else:
            parallelize_default(child, dims, options)


def parallelize_root(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """Apply the plan of a model handed over whole (``fabric.setup(model)``, no LightningModule around it): its
    own ``parallelize``, a ``transformers`` model's, or FSDP per repeated block plus the model itself."""
    if already_parallel(module):
        return
    if isinstance(module, Parallelizable):
        module.parallelize(dims, options)
    elif (plan := hf_plan_for(module)) is not None:
        plan(dims, options)
    else:
        parallelize_default(module, dims, options)


def materialize(module: nn.Module, device: torch.device, agreed_seed: Callable[[int], int]) -> None:
    """Allocate meta tensors on ``device`` and initialise them from one seed for all ranks (``agreed_seed``:
    rank 0's value of its argument, on every rank)."""
    if not has_meta_tensors(module):
        return
    # adapters built on meta: their layers' initialisers know nothing of them (B must start at zero)
    meta_adapters = {name: layer for name, layer in adapters(module).items() if adapter_on_meta(layer)}
    to_empty_except_metrics(module, device)  # metrics keep their states (see there)
    seed = agreed_seed(torch.initial_seed())
    uninitialised: set[str] = set()

    def initialise(current: nn.Module) -> None:
        # before SeededInit: a transformers PreTrainedModel has an init_weights() of another signature
        if initialise_transformers_model(current, seed):
            return
        if isinstance(current, SeededInit):
            current.init_weights(seed)
            return
        owns = any(True for _ in itertools.chain(current.parameters(False), current.buffers(False)))
        if owns:
            reset = getattr(current, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                uninitialised.add(type(current).__name__)
        for child in current.children():
            initialise(child)

    initialise(module)
    init_adapters_(meta_adapters, seed)
    if uninitialised:
        rank_zero_warn(
            f"meta-device modules without init_weights() or reset_parameters() are left uninitialised: "
            f"{', '.join(sorted(uninitialised))}"
        )
