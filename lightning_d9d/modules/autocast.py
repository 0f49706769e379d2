"""The compute dtype under autocast for tensors autocast does not cast itself."""

from __future__ import annotations

import torch


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on for its device, else ``x`` unchanged (differentiable).

    bf16-mixed without FSDP (``D9DStrategy(fsdp_on_one_rank=False)``) autocasts and keeps fp32 parameters. Autocast
    casts matmul operands, but an embedding lookup and a norm's ``weight * x`` keep the parameters' fp32, which
    would carry an fp32 residual stream through every block (twice the bytes of each element-wise kernel). The
    embedding's output and the norms' weights go through here, so the blocks compute in bf16 as under FSDP's
    mixed precision.
    """
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            return x.to(dtype)
    return x
