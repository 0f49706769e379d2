"""The SwiGLU gate ``silu(gate) * up``, forward and backward in one Triton pass each, with the reference beside it.

Elementwise, so memory-bound: the forward reads gate and up once and writes the product; the backward reads
gate, up and the incoming gradient once and writes both gradients (torch eager makes several passes and keeps
``silu(gate)`` for backward). The math is fp32 whatever the dtype, rounded once per output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK = 2048


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@triton.jit
def _swiglu_forward(G, U, Y, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    tl.store(DG + offsets, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offsets, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _launch(kernel: Any, like: torch.Tensor, *args: Any) -> None:
    n = like.numel()
    launchable(kernel, like.device)[(triton.cdiv(n, BLOCK),)](*args, n, BLOCK, num_warps=8)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        _launch(_swiglu_forward, gate, gate, up, y)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _launch(_swiglu_backward, gate, dy.contiguous(), gate, up, dgate, dup)
        return dgate, dup


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match in shape and dtype"
        )
    out: torch.Tensor = _SwiGLU.apply(gate, up)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: Triton on CUDA, the reference elsewhere (see :mod:`lightning_d9d.kernels.dispatch`)."""
    if use_triton("swiglu", gate, up) and gate.shape == up.shape and gate.dtype == up.dtype:
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)
