"""A Triton grouped GEMM for :mod:`lightning_d9d.kernels.grouped_gemm` (backend ``"triton"``), forward and both
gradients, without reading the group sizes on the host.

Rows of ``x`` are cut into ``BLOCK_M``-row tiles that never straddle two groups; which group and first row each
tile has is computed on the device from the group sizes (at most ``cdiv(T, BLOCK_M) + G`` tiles: the grid is
launched that large and the unused tiles return at once). ``x @ w[g]`` and the input gradient ``dy @ w[g]^T``
use that kernel; the weight gradient ``x_g^T @ dy_g`` has one program per (group, output tile) walking its
group's rows. fp32 operands are multiplied in full fp32 (no TF32), so the results equal the loop reference's.

Registered for forcing by name; ``auto`` keeps the other backends until it has been measured on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.kernels.dispatch import interpreting, launchable
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _dot(a, b, FP32: tl.constexpr):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled by Triton
    # fp32 operands: IEEE products (the default would round them to tf32 and miss the fp32 loop's values)
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _grouped_rows_matmul(  # type: ignore[no-untyped-def]
    X,
    W,
    Y,
    TILE_GROUP,
    TILE_ROW,
    GROUP_END,
    n,
    k,
    sxm,
    sxk,
    swg,
    swk,
    swn,
    sym,
    syn,
    FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    tile = tl.program_id(0)
    group = tl.load(TILE_GROUP + tile)
    if group < 0:
        return
    first = tl.load(TILE_ROW + tile)
    end = tl.load(GROUP_END + group)
    rows = first + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for start in range(0, k, BK):
        ks = start + tl.arange(0, BK)
        a = tl.load(
            X + rows[:, None] * sxm + ks[None, :] * sxk,
            mask=(rows[:, None] < end) & (ks[None, :] < k),
            other=0.0,
        )
        b = tl.load(
            W + group * swg + ks[:, None] * swk + cols[None, :] * swn,
            mask=(ks[:, None] < k) & (cols[None, :] < n),
            other=0.0,
        )
        acc += _dot(a, b, FP32)
    mask = (rows[:, None] < end) & (cols[None, :] < n)
    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_weight_grad(  # type: ignore[no-untyped-def]
    X,
    DY,
    DW,
    GROUP_START,
    GROUP_END,
    k,
    n,
    sxm,
    sxk,
    sdm,
    sdn,
    swg,
    swk,
    swn,
    FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    group = tl.program_id(0)
    end = tl.load(GROUP_END + group)
    begin = tl.load(GROUP_START + group)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    acc = tl.zeros((BK, BN), tl.float32)
    for start in range(begin, end, BM):
        rows = start + tl.arange(0, BM)
        a = tl.load(
            X + rows[None, :] * sxm + ks[:, None] * sxk,
            mask=(rows[None, :] < end) & (ks[:, None] < k),
            other=0.0,
        )
        b = tl.load(
            DY + rows[:, None] * sdm + cols[None, :] * sdn,
            mask=(rows[:, None] < end) & (cols[None, :] < n),
            other=0.0,
        )
        acc += _dot(a, b, FP32)
    mask = (ks[:, None] < k) & (cols[None, :] < n)
    tl.store(
        DW + group * swg + ks[:, None] * swk + cols[None, :] * swn, acc.to(DW.dtype.element_ty), mask=mask
    )


def _tiles(group_sizes: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group of each tile or -1, first row of each tile, end row of each group), all on the device."""
    sizes = group_sizes.to(torch.int64)
    ends = torch.cumsum(sizes, 0)
    per_group = torch.div(sizes + BLOCK_M - 1, BLOCK_M, rounding_mode="floor")
    tile_ends = torch.cumsum(per_group, 0)
    upper = triton.cdiv(rows, BLOCK_M) + sizes.numel()
    tile = torch.arange(upper, device=sizes.device)
    group = torch.searchsorted(tile_ends, tile, right=True)
    valid = group < sizes.numel()
    safe = group.clamp(max=sizes.numel() - 1)
    first_row = (ends - sizes)[safe] + (tile - (tile_ends - per_group)[safe]) * BLOCK_M
    return torch.where(valid, group, -1).to(torch.int32), first_row, ends


def _rows_matmul(x: torch.Tensor, w: torch.Tensor, tiles: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g]`` with ``w`` any strided ``[G, K, N]`` view."""
    tile_group, first_row, ends = tiles
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    launchable(_grouped_rows_matmul, x.device)[(tile_group.numel(), triton.cdiv(n, BLOCK_N))](
        x, w, y, tile_group, first_row, ends, n, x.shape[1],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        x.dtype == torch.float32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    return y


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tiles = _tiles(group_sizes, x.shape[0])
        ctx.save_for_backward(x, w, group_sizes.to(torch.int64), *tiles)
        return _rows_matmul(x, w, tiles, w.shape[2])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w, group_sizes, *tiles = ctx.saved_tensors
        dx = (
            _rows_matmul(dy, w.transpose(1, 2), tuple(tiles), w.shape[1]) if ctx.needs_input_grad[0] else None
        )
        dw = None
        if ctx.needs_input_grad[1]:
            groups, k, n = w.shape
            dw = torch.empty_like(w)
            launchable(_grouped_weight_grad, x.device)[(groups, triton.cdiv(k, BLOCK_K), triton.cdiv(n, BLOCK_N))](
                x, dy, dw, tiles[2] - group_sizes, tiles[2], k, n,
                x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
                x.dtype == torch.float32, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        return dx, dw, None


def triton_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[T, K] x [G, K, N] -> [T, N]``, rows grouped consecutively by ``group_sizes`` (not read on the host)."""
    out: torch.Tensor = _GroupedMM.apply(x, w, group_sizes)
    return out


def triton_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        return f"the Triton grouped GEMM takes bf16, fp16 or fp32 operands of one dtype, got {x.dtype} and {w.dtype}"
    if x.is_cuda or (x.device.type == "cpu" and interpreting()):
        return None
    return f"the Triton grouped GEMM runs on CUDA (or on CPU with TRITON_INTERPRET=1), got {x.device}"
