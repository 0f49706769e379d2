"""Rotary embedding ("rotate half" layout) of q and k in one Triton pass, forward and backward, with the
reference beside it.

One program per (sequence, position) reads that position's cos/sin once and rotates every query and key head
there; q and k keep whatever strides they come with (``[B, heads, T, head_dim]`` views of the projections'
``[B, T, heads, head_dim]`` outputs are read in place, no copies), and the outputs get the same layout. The
backward is the inverse rotation of the incoming gradients. cos/sin are constants (no gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` over the last dim (a 90-degree rotation of each ``(a_i, b_i)`` pair)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference: ``q``/``k``: ``[B, heads, T, head_dim]``; ``cos``/``sin``: ``[B or 1, T, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    C,
    S,
    QO,
    KO,
    seq_len,
    q_heads,
    k_heads,
    half,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sqob,
    sqoh,
    sqot,
    skob,
    skoh,
    skot,
    scb,
    sct,
    ssb,
    sst,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    t = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos1 = tl.load(C + b * scb + t * sct + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(C + b * scb + t * sct + half + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(S + b * ssb + t * sst + d, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(S + b * ssb + t * sst + half + d, mask=dmask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose of the rotation: x1 c1 + x2 s2, x2 c2 - x1 s1
        sin2, sin1 = -sin1, -sin2
    # queries
    h = tl.arange(0, BLOCK_QH)
    mask = (h[:, None] < q_heads) & dmask[None, :]
    src = Q + b * sqb + t * sqt + h[:, None] * sqh + d[None, :]
    dst = QO + b * sqob + t * sqot + h[:, None] * sqoh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(QO.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(QO.dtype.element_ty), mask=mask)
    # keys
    h = tl.arange(0, BLOCK_KH)
    mask = (h[:, None] < k_heads) & dmask[None, :]
    src = K + b * skb + t * skt + h[:, None] * skh + d[None, :]
    dst = KO + b * skob + t * skot + h[:, None] * skoh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(KO.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(KO.dtype.element_ty), mask=mask)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_apply(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (or with ``inverse`` rotate back) ``q`` and ``k`` in one launch; outputs keep the inputs' layout."""
    q, k, cos, sin = (_last_dim_dense(x) for x in (q, k, cos, sin))
    batch, q_heads, seq_len, head_dim = q.shape
    k_heads = k.shape[1]
    half = head_dim // 2
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_b = sin.stride(0) if sin.shape[0] > 1 else 0
    block_d = triton.next_power_of_2(half)
    kernel = launchable(_rope_kernel, q.device)
    kernel[(batch * seq_len,)](
        q, k, cos, sin, q_out, k_out,
        seq_len, q_heads, k_heads, half,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_b, cos.stride(1), sin_b, sin.stride(1),
        triton.next_power_of_2(q_heads), triton.next_power_of_2(k_heads), block_d, inverse,
        num_warps=4,
    )  # fmt: skip
    return q_out, k_out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return rope_apply(q, k, cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_apply(dq, dk, cos, sin, inverse=True)
        return dq_in, dk_in, None, None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, heads, T, head_dim] with equal B, T, head_dim"
        )
    batch, _, seq_len, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 3 or table.shape[1:] != (seq_len, head_dim) or table.shape[0] not in (1, batch):
            raise ValueError(f"{name} {tuple(table.shape)} must be [1 or {batch}, {seq_len}, {head_dim}]")


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, cos, sin)
    q_out, k_out = _Rope.apply(q, k, cos.detach(), sin.detach())
    return q_out, k_out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (``[B, heads, T, head_dim]``) by the angles whose ``cos``/``sin`` are
    ``[B or 1, T, head_dim]``: both in one Triton pass on CUDA (when cos/sin need no gradient), the PyTorch
    reference elsewhere."""
    plain = not (cos.requires_grad or sin.requires_grad) and q.dtype == k.dtype
    if plain and use_triton("rope", q, k, cos, sin):
        return rope_triton(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
