"""Root-mean-square layer norm."""

from __future__ import annotations

import torch
from torch import nn

from lightning_d9d.kernels.rmsnorm import rms_norm
from lightning_d9d.modules.autocast import to_autocast_dtype


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim.

    The statistics are computed in fp32 and the normalised value is cast back to the input dtype *before* the
    weight is applied, which is the order Hugging Face's Qwen/Llama norms use: bf16 outputs then match theirs.
    Any leading shape: Qwen3's q/k norms normalise ``[B, T, heads, head_dim]`` per head.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A Triton kernel on CUDA, the PyTorch reference elsewhere (lightning_d9d.kernels.dispatch). Under
        # autocast the weight is taken in the compute dtype, as FSDP's mixed precision would hand it over.
        return rms_norm(x, to_autocast_dtype(self.weight), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
