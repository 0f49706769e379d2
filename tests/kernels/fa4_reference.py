"""A CPU stand-in for FlashAttention 4's interface module (``flash_attn.cute.interface``), for tests without a GPU:
the three functions ``lightning_d9d.kernels.flash_attn4`` calls, with FA4's layouts and its shape checks, computed as
plain causal softmax attention in fp32. ``install(monkeypatch)`` puts it in place of the real module.

What it mirrors (read from flash-attn-4 4.0.0b40's ``interface.py``): ``flash_attn_func`` / ``flash_attn_varlen_func``
take ``[B, T, H, D]`` / ``[total, H, D]`` with grouped key/value heads, int32 ``cu_seqlens``, and return ``(out,
lse)`` with ``out`` freshly allocated (contiguous, the queries' dtype) and ``lse`` fp32 ``[B, H, T]`` /
``[H, total]``; ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, ...)`` returns ``(dq, dk, dv)``
shaped like (and as contiguous as) its inputs.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_d9d.kernels import flash_attn4

CALLS: list[str] = []


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, H, D] (k/v [B, T, H_kv, D]) -> out [B, T, H, D] in q's dtype, lse [B, H, T] fp32."""
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))
    kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    scores = qh @ kh.transpose(-1, -2) * scale
    length = q.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ vh
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous()


def _check_varlen(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> list[int]:
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0], (q.shape, k.shape)
    assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[0]) == 0 and int(cu[-1]) == q.shape[0], cu
    bounds = cu.tolist()
    assert max(b - a for a, b in itertools.pairwise(bounds)) <= max_seqlen
    return bounds


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = _check_varlen(q, k, cu, max_seqlen)
    outs, lses = [], []
    for start, end in itertools.pairwise(bounds):
        out, lse = _dense(*(x[None, start:end] for x in (q, k, v)), scale)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs).contiguous(), torch.cat(lses, dim=1).contiguous()


def flash_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.dim() == 4 and k.shape == v.shape and k.shape[:2] == q.shape[:2], (q.shape, k.shape)
    assert kw["causal"] is True and kw["return_lse"] is True
    CALLS.append("forward")
    return _dense(q, k, v, kw["softmax_scale"])


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    assert kw["cu_seqlens_q"] is kw["cu_seqlens_k"] and kw["max_seqlen_q"] == kw["max_seqlen_k"]
    assert kw["causal"] is True and kw["return_lse"] is True
    CALLS.append("varlen forward")
    return _varlen(q, k, v, kw["cu_seqlens_q"], kw["max_seqlen_q"], kw["softmax_scale"])


def _dense_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention's gradients by hand, with the probabilities rebuilt from the forward's ``lse`` as FA4's
    backward does (a custom operator's kernel runs below autograd: no ``torch.autograd.grad`` in here)."""
    batch, length, heads, _ = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    qh, kh, vh, doh = (x.transpose(1, 2).float() for x in (q, k, v, dout))
    kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = ((qh @ kh.transpose(-1, -2) * scale) - lse[..., None]).exp().masked_fill(~causal, 0.0)
    out = probs @ vh
    dv = probs.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    ds = probs * (dp - (doh * out).sum(-1, keepdim=True))
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] summed over each kv head's query group
        return x.view(batch, kv_heads, groups, length, -1).sum(2)

    return tuple(  # type: ignore[return-value]
        x.transpose(1, 2).to(dtype).contiguous()
        for x, dtype in ((dq, q.dtype), (per_kv_head(dk), k.dtype), (per_kv_head(dv), v.dtype))
    )


def _flash_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert causal and out.shape == dout.shape == (*q.shape[:-1], v.shape[-1]) and lse.dtype == torch.float32
    CALLS.append("backward")
    if kw.get("cu_seqlens_q") is None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        return _dense_backward(q, k, v, dout, lse, softmax_scale)
    assert lse.shape == (q.shape[1], q.shape[0])
    bounds = _check_varlen(q, k, kw["cu_seqlens_q"], kw["max_seqlen_q"])
    parts = [
        _dense_backward(
            *(x[None, start:end] for x in (q, k, v, dout)), lse[None, :, start:end], softmax_scale
        )
        for start, end in itertools.pairwise(bounds)
    ]
    return tuple(torch.cat([part[i][0] for part in parts]).contiguous() for i in range(3))  # type: ignore[return-value]


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA4's interface replaced by this module's functions (any device, here CPU)."""
    CALLS.clear()
    stand_in = SimpleNamespace(
        flash_attn_func=flash_attn_func,
        flash_attn_varlen_func=flash_attn_varlen_func,
        _flash_attn_bwd=_flash_attn_bwd,
    )
    monkeypatch.setattr(flash_attn4, "_interface", lambda: stand_in)
