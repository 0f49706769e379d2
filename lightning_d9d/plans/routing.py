"""MoE blocks under tensor parallelism: every tp rank routes its own sequence shard.

Between the attention and MLP projections sequence parallelism leaves each tp rank 1/tp of every sequence's
positions. An MoE block runs on exactly those (:func:`~lightning_d9d.plans.local_to_sequence_shard`): each
token goes through the router and its experts once, on the rank that holds it, as on a data-parallel rank,
instead of every tp rank repeating the whole sequence's expert work. The block's weights stay whole on every
tp rank, so each rank's gradients hold only its own tokens:

- the router and the shared experts (the experts too without ep) become one FSDP unit over the data ranks whose
  all-reduce hook sums the reduced gradient over tp (FSDP has averaged it over the data ranks first);
- with ep the experts are split over ep ranks carved from dp_shard x cp x tp (the expert mesh of
  :class:`~lightning_d9d.mesh.ParallelDims`): every tp rank's tokens reach them through the dispatcher and FSDP
  over ``efsdp`` adds up the rest (:func:`~lightning_d9d.plans.parallelize_expert`);
- the router losses count tokens per expert over the ``sequence`` view (the cp x tp ranks that hold parts of
  the same sequences: :func:`~lightning_d9d.models.qwen3_moe.split_sequences`), and each rank puts 1/tp of
  their gradient in (``MoE.router_loss_share``): the tp sum adds tp such shares.

Call it after :func:`~lightning_d9d.plans.parallelize_expert` and before
:func:`~lightning_d9d.plans.parallelize_blocks`; without tp it does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe import MoE
from lightning_d9d.plans.data_parallel import data_parallel_mesh
from lightning_d9d.plans.options import ParallelOptions


def route_on_sequence_shards(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> list[MoE]:
    """Prepare every MoE block of ``module`` to route this tp rank's positions (see the module docstring);
    returns the blocks changed."""
    blocks = [child for child in module.modules() if isinstance(child, MoE)]
    if not dims.tp_enabled or not blocks:
        return []
    for block in blocks:
        block.router_loss_share = 1.0 / dims.tp
    sum_gradients_over_tp(blocks, dims, options)
    return blocks


def sum_gradients_over_tp(blocks: Iterable[nn.Module], dims: ParallelDims, options: ParallelOptions) -> None:
    """Each of ``blocks`` (whole on every tp rank, run on this rank's positions only) becomes one FSDP unit
    over the data ranks whose reduced gradients are then summed over tp: every tp rank's tokens count once.
    Parameters already in a unit of their own (the experts under ep) are left to it. Without tp: nothing."""
    if not dims.tp_enabled:
        return
    tp_group = dims.mesh_for("tp").get_group()
    for block in blocks:
        unit = fully_shard(
            block,
            mesh=data_parallel_mesh(dims),
            mp_policy=options.mp_policy or MixedPrecisionPolicy(),
            reshard_after_forward=options.reshards(dims.fsdp),
        )
        unit.set_all_reduce_hook(partial(_sum_over, group=tp_group))


def _sum_over(gradient: torch.Tensor, *, group: dist.ProcessGroup) -> None:
    dist.all_reduce(gradient, op=dist.ReduceOp.SUM, group=group)
