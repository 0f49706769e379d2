"""Choose FSDP, HSDP or DDP-like replication from the degrees: the last step of every model's plan."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans.fsdp import parallelize_fsdp
from lightning_d9d.plans.options import ParallelOptions
from lightning_d9d.plans.replicate import parallelize_replicate


def parallelize_data(
    module: nn.Module, dims: ParallelDims, options: ParallelOptions, *, blocks: Iterable[nn.Module] = ()
) -> None:
    """Apply data parallelism to ``module`` (one FSDP unit per block of ``blocks``, then the root).

    Applied on one rank too unless ``options.fsdp_on_one_rank`` is off: parameters then are ``DTensor``s on
    every layout. Off, a one-rank world keeps plain parameters: FSDP there only copies (each block's parameters
    cast and "all-gathered" into a second buffer every forward, and again in backward where
    ``reshard_after_forward=True`` freed them; gradients copied out again: about 6 % of a compiled 0.6B training
    step on an H200), though autocast, which then does the casting, costs about as much.
    """
    if not wraps_in_fsdp(dims, options):
        return
    if dims.dp_replicate > 1:
        parallelize_replicate(
            module,
            data_parallel_mesh(dims),
            blocks=blocks,
            mp_policy=options.mp_policy,
            reshard_after_forward=options.reshards(dims.fsdp),
        )
    else:
        parallelize_fsdp(
            module,
            data_parallel_mesh(dims),
            blocks=blocks,
            mp_policy=options.mp_policy,
            reshard_after_forward=options.reshards(dims.fsdp),
        )


def wraps_in_fsdp(dims: ParallelDims, options: ParallelOptions) -> bool:
    """Whether :func:`parallelize_data` makes FSDP units of the blocks (FSDP or HSDP): on every world of more
    than one rank, and on one rank unless ``options.fsdp_on_one_rank`` is off."""
    return options.fsdp_on_one_rank or dims.world_size > 1


def data_parallel_mesh(dims: ParallelDims) -> DeviceMesh:
    """The mesh a data-parallel FSDP unit spans: the 2-D ``hsdp`` view under HSDP, else ``fsdp``."""
    return dims.mesh_for("hsdp") if dims.dp_replicate > 1 else dims.mesh_for("fsdp")
