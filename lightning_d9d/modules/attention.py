"""Causal grouped-query self-attention with optional per-head q/k norms (Qwen3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_d9d.modules.norm import RMSNorm
from lightning_d9d.modules.rope import apply_rotary


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv_heads, T, D] -> [B, kv_heads * groups, T, D]``, each kv head repeated for its query group."""
    if groups == 1:
        return x
    b, kv_heads, t, d = x.shape
    return x[:, :, None].expand(b, kv_heads, groups, t, d).reshape(b, kv_heads * groups, t, d)


class Attention(nn.Module):
    """Causal self-attention with ``num_kv_heads`` key/value heads shared by groups of query heads.

    With ``qk_norm`` each query and key head is RMS-normalised (one weight of size ``head_dim`` shared by all
    heads) before RoPE, as Qwen3 does. Grouped key/value heads go to SDPA as they are (``enable_gqa``):
    repeating them first cost 1.8 GiB and 4% of forward time on the Qwen3-0.6B shape on an H200
    (docs/benchmarks.md). ``repeat_kv_heads=True`` repeats them instead, for attention paths that need equal
    head counts (torch's context-parallel SDPA).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, device=device)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, device=device)
        self.q_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, device=device) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, device=device) if qk_norm else None
        self.repeat_kv_heads = False
        # Set by a context-parallel plan: attends this rank's queries to the whole sequence's keys and values
        # (``AllGatherAttention``); None attends within the local sequence.
        self.context: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, hidden]``; ``cos``/``sin``: ``[B or 1, T, head_dim]``. Returns ``[B, T, hidden]``."""
        b, t, _ = x.shape
        # -1 instead of the configured head counts: under tensor parallelism each rank holds only some heads.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if self.context is not None:
            return self.o_proj(self.context(q, k, v).transpose(1, 2).reshape(b, t, -1))
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and self.repeat_kv_heads:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=groups > 1 and not self.repeat_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
