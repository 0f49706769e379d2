"""Gated feed-forward block (SwiGLU)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_d9d.kernels.swiglu import swiglu


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the feed-forward of Llama/Qwen (parameter names as in their checkpoints)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up in one Triton pass on CUDA, the PyTorch reference elsewhere.
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
