"""The SwiGLU gate ``silu(gate) * up``, forward and backward in one Triton pass each, with the reference beside it.

Elementwise, so memory-bound: the forward reads gate and up once and writes the product; the backward reads
gate, up and the incoming gradient once and writes both gradients (torch eager makes several passes and keeps
``silu(gate)`` for backward). The math is fp32 whatever the dtype, rounded once per output.

The MoE experts' variant, ``silu(gate) * up * w`` with one routing weight per row (:func:`weighted_swiglu`),
runs row tiles: its backward also reduces each row's weight gradient (``sum(dy * silu(gate) * up)``, in fp32, in
a fixed order), and it reads gate and up through their row stride, so the two halves of the experts' one
``[rows, 2 * ffn]`` projection are read in place, not copied first. Under ``torch.compile`` the reference runs
(Inductor fuses the same pass).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.permute import weigh_rows
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK = 2048
# Elements of one weighted-SwiGLU tile (rows x columns).
ROW_TILE = 4096
# tests/gpu/test_kernels_gpu.py's weighted SwiGLU test checks it against the reference on a GPU, so ``auto`` runs
# it on CUDA (``LIGHTNING_D9D_KERNELS=torch`` keeps the reference).
WEIGHTED_SWIGLU_GPU_CHECKED = True


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


def weighted_swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, row_weights: torch.Tensor
) -> torch.Tensor:
    return weigh_rows(F.silu(gate) * up, row_weights)


@triton.jit
def _weighted_swiglu_forward(  # type: ignore[no-untyped-def]
    G, U, W, Y, rows, cols, g_stride, u_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = row < rows
    w = tl.load(W + row, mask=row_mask, other=0.0).to(tl.float32)
    for start in range(0, cols, BLOCK):
        col = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (col < cols)[None, :]
        g = tl.load(G + row[:, None] * g_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row[:, None] * u_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(Y + row[:, None] * cols + col[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_swiglu_backward(  # type: ignore[no-untyped-def]
    DY, G, U, W, DG, DU, DW, rows, cols, g_stride, u_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = row < rows
    w = tl.load(W + row, mask=row_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS,), tl.float32)
    for start in range(0, cols, BLOCK):
        col = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (col < cols)[None, :]
        dy = tl.load(DY + row[:, None] * cols + col[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row[:, None] * g_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row[:, None] * u_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dw += tl.sum(dy * silu * u, axis=1)
        dyw = dy * w[:, None]
        out = row[:, None] * cols + col[None, :]
        tl.store(DG + out, (dyw * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + out, (dyw * silu).to(DU.dtype.element_ty), mask=mask)
    tl.store(DW + row, dw.to(DW.dtype.element_ty), mask=row_mask)


def _row_tile(cols: int) -> tuple[int, int]:
    """(rows, columns) of a tile: columns a power of two up to 1024, rows filling ``ROW_TILE`` elements."""
    block = min(1024, triton.next_power_of_2(max(cols, 1)))
    return max(1, ROW_TILE // block), block


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its rows are contiguous (any row stride: a column slice), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up, row_weights = _row_major(gate), _row_major(up), row_weights.contiguous()
        rows, cols = gate.shape
        y = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
        tile_rows, block = _row_tile(cols)
        launchable(_weighted_swiglu_forward, gate.device)[(triton.cdiv(rows, tile_rows),)](
            gate, up, row_weights, y, rows, cols, gate.stride(0), up.stride(0), tile_rows, block, num_warps=8
        )
        ctx.save_for_backward(gate, up, row_weights)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up, row_weights = ctx.saved_tensors
        rows, cols = gate.shape
        dgate = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
        dup = torch.empty_like(dgate)
        dweights = torch.empty_like(row_weights)
        tile_rows, block = _row_tile(cols)
        launchable(_weighted_swiglu_backward, gate.device)[(triton.cdiv(rows, tile_rows),)](
            dy.contiguous(), gate, up, row_weights, dgate, dup, dweights, rows, cols, gate.stride(0),
            up.stride(0), tile_rows, block, num_warps=8,
        )  # fmt: skip
        return dgate, dup, dweights


def weighted_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    if (
        gate.dim() != 2
        or gate.shape != up.shape
        or gate.dtype != up.dtype
        or row_weights.shape != gate.shape[:1]
    ):
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype} and row_weights "
            f"{tuple(row_weights.shape)}: gate and up [rows, ffn] of one dtype, one weight per row"
        )
    out: torch.Tensor = _WeightedSwiGLU.apply(gate, up, row_weights)
    return out


def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    """``silu(gate) * up`` with row ``r`` times ``row_weights[r]`` (gate and up ``[rows, ffn]``; plain
    :func:`swiglu` when ``row_weights`` is None): Triton on CUDA once its GPU test has passed
    (``WEIGHTED_SWIGLU_GPU_CHECKED``), the reference elsewhere (see :mod:`lightning_d9d.kernels.dispatch`)."""
    if row_weights is None:
        return swiglu(gate, up)
    if (
        use_triton("weighted_swiglu", gate, up, row_weights, gpu_checked=WEIGHTED_SWIGLU_GPU_CHECKED)
        and gate.dim() == 2
        and gate.shape == up.shape
        and gate.dtype == up.dtype
    ):
        return weighted_swiglu_triton(gate, up, row_weights)
    return weighted_swiglu_reference(gate, up, row_weights)
