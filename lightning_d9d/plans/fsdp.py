"""FSDP2 (``fully_shard``) over the ``fsdp`` mesh view, or over the 2-D ``hsdp`` view for HSDP."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def parallelize_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Shard ``module`` with FSDP2: each of ``blocks`` becomes its own unit, then ``module`` takes the rest.

    ``mesh`` is 1-D (plain FSDP) or 2-D ``(replicate, shard)`` (HSDP; a shard dim of size 1 gives DDP-like
    replication with DTensor parameters). One unit per repeated block is what lets FSDP overlap the next
    block's all-gather with the current block's compute.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"parallelize_fsdp needs a 1-D or 2-D mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    block_list = list(blocks)
    for index, block in enumerate(block_list):
        # The last block's parameters are needed again right away by backward: keeping them saves an all-gather.
        reshard = reshard_after_forward and index < len(block_list) - 1
        if not isinstance(block, FSDPModule):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
