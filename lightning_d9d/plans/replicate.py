"""Replication over ``dp_replicate``: HSDP when ``dp_shard > 1``, DDP-like when parameters are not sharded."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_d9d.plans.fsdp import parallelize_fsdp


def parallelize_replicate(
    module: nn.Module,
    hsdp_mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Replicate ``module`` over the first dim of the 2-D ``(dp_replicate, fsdp)`` mesh, shard over the second.

    FSDP2 on a 2-D mesh is HSDP: reduce-scatter inside a replica group, all-reduce across groups. With a shard
    dim of size 1 nothing is sharded and only the all-reduce remains, which is DDP with DTensor parameters, so
    checkpoints and norm clipping treat both layouts alike.
    """
    if hsdp_mesh.ndim != 2:
        raise ValueError(
            f"parallelize_replicate needs the 2-D (dp_replicate, fsdp) mesh, got {hsdp_mesh.ndim}-D"
        )
    parallelize_fsdp(
        module,
        hsdp_mesh,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
    )
