"""Rotary position embedding (RoPE) in the "rotate half" layout.

The two halves of each head are the two coordinates of a rotation (dims ``i`` and ``i + head_dim/2`` rotate
together), the layout Hugging Face checkpoints are trained with; weights are therefore interchangeable with
theirs without permuting ``q_proj`` / ``k_proj`` rows.
"""

from __future__ import annotations

import torch
from torch import nn

# One implementation of the rotation, in kernels/ (below this layer); re-exported under the names blocks use.
from lightning_d9d.kernels.rope import apply_rope as apply_rotary
from lightning_d9d.kernels.rope import rotate_half

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inverse_frequencies", "rotate_half"]


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta**(2i / head_dim)`` for ``i < head_dim / 2``, in fp32 on CPU."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    # Explicit device: a caller's ``with torch.device(...)`` context must not move this off the CPU.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions ``0 .. max_positions-1`` and looks them up by position.

    The tables are non-persistent buffers (not in the state dict: they are derived from the config). They are
    computed in fp32; if the module is later cast (``model.to(torch.bfloat16)``) the tables are rounded once,
    which matches what Hugging Face does when it casts its fp32 cos/sin to the activation dtype. After
    ``to_empty()`` the buffers hold garbage: call :meth:`reset_parameters`.
    """

    inv_freq: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        # fp32 even under a bf16 default dtype (Lightning's "bf16-true" init context): lookups cast later.
        fp32 = torch.float32
        self.register_buffer(
            "inv_freq", torch.empty(head_dim // 2, dtype=fp32, device=device), persistent=False
        )
        self.register_buffer(
            "cos", torch.empty(max_positions, head_dim, dtype=fp32, device=device), persistent=False
        )
        self.register_buffer(
            "sin", torch.empty(max_positions, head_dim, dtype=fp32, device=device), persistent=False
        )
        if self.inv_freq.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the tables in fp32 on CPU and copy them into the buffers, keeping their device/dtype."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").to(torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.inv_freq.copy_(inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(
        self, position_ids: torch.Tensor | None, seq_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[B or 1, T, head_dim]`` in ``dtype``.

        ``position_ids`` is ``[B, T]`` (or ``[T]``); ``None`` means ``0 .. seq_len-1`` for every sequence.
        """
        if position_ids is None:
            if seq_len > self.max_positions:
                raise ValueError(
                    f"sequence length ({seq_len}) exceeds max_position_embeddings ({self.max_positions})"
                )
            cos, sin = self.cos[:seq_len].unsqueeze(0), self.sin[:seq_len].unsqueeze(0)
        else:
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0)
            cos, sin = self.cos[position_ids], self.sin[position_ids]
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.theta}"
