"""Choose FSDP, HSDP or DDP-like replication from the degrees: the last step of every model's plan."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans.fsdp import parallelize_fsdp
from lightning_d9d.plans.options import ParallelOptions
from lightning_d9d.plans.replicate import parallelize_replicate


def parallelize_data(
    module: nn.Module, dims: ParallelDims, options: ParallelOptions, *, blocks: Iterable[nn.Module] = ()
) -> None:
    """Apply data parallelism to ``module`` (one FSDP unit per block of ``blocks``, then the root).

    Always applied, even on one rank: parameters then are ``DTensor``s on every layout, which is what the
    checkpoint code and distributed norm clipping rely on.
    """
    if dims.dp_replicate > 1:
        parallelize_replicate(
            module,
            dims.mesh_for("hsdp"),
            blocks=blocks,
            mp_policy=options.mp_policy,
            reshard_after_forward=options.reshard_after_forward,
        )
    else:
        parallelize_fsdp(
            module,
            dims.mesh_for("fsdp"),
            blocks=blocks,
            mp_policy=options.mp_policy,
            reshard_after_forward=options.reshard_after_forward and dims.fsdp > 1,
        )
