"""Expert parallelism: each MoE block's experts split over the ``ep`` ranks, tokens moved by a dispatcher.

What :func:`parallelize_expert` does to every :class:`~lightning_d9d.modules.moe.MoE` block of a module:

- the stacked expert weights become ``DTensor``s sharded on dimension 0 (the expert) over the ``ep`` mesh
  (torch's ``distribute_module``): ep rank ``r`` holds experts ``r * E/ep ... (r+1) * E/ep - 1``; LoRA's
  per-expert adapters beside them (``experts.lora``, the expert on dimension 0 too) are split alike, so each rank
  holds the adapters of its own experts;
- the block's dispatcher becomes the expert-parallel one (all-to-all by default, DeepEP on request: see
  :func:`~lightning_d9d.modules.moe.expert_parallel_dispatcher`);
- the experts become their own FSDP unit over the data ranks that hold the same experts (``efsdp``, or the 2-D
  ``ehsdp`` under HSDP). The router and shared experts are untouched here: they are replicated over ``ep``
  like every dense weight and the model's data-parallel plan shards them with the rest of the block.

Gradient scale: an expert's gradient on one rank already sums the contributions of the tokens of all ``ep``
peers (the all-to-all's backward brings them), while FSDP would divide the reduced sum only by the ``efsdp``
(x dp_replicate) ranks it reduces over. Dividing instead by every rank whose loss is averaged (the ``loss``
view: dp_replicate x dp_shard x cp) gives the mean over all tokens, as for the dense weights. Under tensor
parallelism each tp rank routes its own positions (:mod:`lightning_d9d.plans.routing`) and ep is carved from
dp_shard x cp x tp, so every token still reaches the experts once: the same divisor.

Call it before :func:`~lightning_d9d.plans.parallelize_blocks` (which adds checkpointing, compile and the data
parallelism of everything else). Without ep (``ep == 1``) it does nothing.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe import MoE, expert_parallel_dispatcher
from lightning_d9d.plans.options import ParallelOptions


def parallelize_expert(
    module: nn.Module, dims: ParallelDims, options: ParallelOptions, *, dispatch_backend: str | None = None
) -> list[MoE]:
    """Split the experts of every MoE block in ``module`` over ``ep`` (see the module docstring); returns the
    blocks changed. ``dispatch_backend``: ``"all_to_all"`` (default) or ``"deepep"``."""
    blocks = [child for child in module.modules() if isinstance(child, MoE)]
    if not dims.ep_enabled or not blocks:
        return []
    for block in blocks:
        check_expert_split(block, dims.ep)
    for block in blocks:
        split_expert_weights(block.experts, dims, options)
        block.dispatcher = expert_parallel_dispatcher(
            dims.mesh_for("ep").get_group(), block.gate.num_experts, backend=dispatch_backend
        )
    return blocks


def split_expert_weights(experts: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """Every parameter of ``experts`` and its submodules (stacked weights and LoRA's per-expert adapters, the
    expert on dimension 0) sharded over ``ep``, then ``experts`` made its own FSDP unit over the data ranks that
    hold the same experts, its gradients divided as the module docstring says (the adapters' with the weights').
    The caller brings the tokens (a dispatcher over the ``ep`` group)."""
    distribute_module(experts, dims.mesh_for("ep"), _shard_experts)
    expert_dp_mesh = dims.mesh_for("ehsdp") if dims.dp_replicate > 1 else dims.mesh_for("efsdp")
    _shard_expert_data(experts, expert_dp_mesh, options, dims.mesh_for("loss").size())


def check_expert_split(block: MoE, ep: int) -> None:
    """Every ep rank must hold the same whole number of experts (checked before any collective)."""
    experts = block.gate.num_experts
    if experts % ep != 0:
        raise ValueError(
            f"ep ({ep}) must divide the number of experts ({experts}): each ep rank holds experts / ep of them; "
            f"choose an ep among the divisors of {experts}"
        )


def _shard_experts(name: str, experts: nn.Module, mesh: DeviceMesh) -> None:
    # distribute_module calls this for the experts module and each submodule (the adapters' factors) in turn
    for param_name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _shard_expert_data(
    experts: nn.Module, mesh: DeviceMesh, options: ParallelOptions, averaged_over: int
) -> None:
    sharded = fully_shard(
        experts,
        mesh=mesh,
        mp_policy=options.mp_policy or MixedPrecisionPolicy(),
        # Experts are most of an MoE's weights: their gathered copies are freed after forward unless asked
        # otherwise, even where efsdp is one rank.
        reshard_after_forward=options.reshard_after_forward is not False,
    )
    sharded.set_gradient_divide_factor(float(averaged_over))
    shard_group = mesh.get_group(mesh.ndim - 1)
    if shard_group.size() > 1 and dist.get_backend(shard_group) != "nccl":
        # A custom factor is NCCL's PreMulSum, which gloo lacks: sum, then divide. (Not on one shard rank:
        # there torch 2.13 divides the copied gradient by the factor and then again after the sum.)
        sharded.set_force_sum_reduction_for_comms(True)
