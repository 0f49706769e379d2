"""RMSNorm over the last dim, forward and backward in Triton, with the PyTorch reference beside it.

The numbers are the reference's (Hugging Face's order): statistics in fp32, the normalised value rounded to the
input dtype, *then* times the weight. Rows of any length (hidden sizes, Qwen3's per-head q/k norms over
``head_dim``) are processed a tile of rows per program; the weight's gradient is summed per program in fp32
and the partial sums added once at the end.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _rms_norm_forward(  # type: ignore[no-untyped-def]
    X, W, Y, RSTD, rows, cols, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # pragma: no cover - compiled by Triton
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_N)
    mask = (row[:, None] < rows) & (col[None, :] < cols)
    offsets = row[:, None].to(tl.int64) * cols + col[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / cols + eps)
    normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + col, mask=col < cols, other=0.0).to(tl.float32)
    tl.store(Y + offsets, (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd, mask=row < rows)


@triton.jit
def _rms_norm_backward(  # type: ignore[no-untyped-def]
    DY,
    X,
    W,
    RSTD,
    DX,
    DW,
    rows,
    cols,
    tiles,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK_N)
    w = tl.load(W + col, mask=col < cols, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # STAGES > 1: Triton prefetches the next tiles' rows while this one is reduced (software pipelining)
    for tile in tl.range(pid, tiles, programs, num_stages=STAGES):
        row = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (row[:, None] < rows) & (col[None, :] < cols)
        offsets = row[:, None].to(tl.int64) * cols + col[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < rows, other=0.0)
        normed = x * rstd[:, None]
        dw += tl.sum(dy * normed.to(X.dtype.element_ty).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (dn - normed * mean(dn * normed))
        dx = rstd[:, None] * (dn - normed * (tl.sum(dn * normed, axis=1) / cols)[:, None])
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * cols + col, dw, mask=col < cols)


# The launch shape: rows per program tile (TILE_ELEMENTS / the padded row length, at most 32) and the backward's
# persistent programs per SM. benchmarks/kernel_speed.py sweeps both on the GPU (docs/benchmarks.md, run G10's raw
# results, H200): 4096 / 8 is the fastest pair for both shapes, 2048 or 8192 elements slower; with the stages below,
# fwd+bwd 0.059 ms at [4, 4096, 1024] (torch.compile 0.060) and 0.106 ms for the q/k-norm shape (compile 0.318; run
# G2's raw results).
TILE_ELEMENTS = 4096
PROGRAMS_PER_SM = 8
# The backward's software pipelining (Triton prefetching the next tiles' rows while one is reduced): pays once
# each program loops over enough tiles. 3 stages against 1 at tile 4096, 8 per SM (docs/benchmarks.md, run G10's
# raw results): q/k-norm shape (7.8 tiles per program) 0.107 vs 0.112 ms, hidden 4096 (15.5) 0.183 vs 0.190 ms,
# hidden 1024 (3.9) 0.060 vs 0.058 ms; with the rule in place (run G2): 0.106 vs 0.112, 0.183 vs 0.189, 0.0589 vs
# 0.0590 ms. None picks by that count; an int forces it (the benchmark's sweep).
BACKWARD_STAGES: int | None = None
PIPELINED_STAGES = 3
PIPELINE_FROM_TILES_PER_PROGRAM = 6


def _blocks(cols: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(cols)
    block_m = max(1, min(32, TILE_ELEMENTS // block_n))
    warps = 4 if block_n * block_m <= 4096 else 8
    return block_m, block_n, warps


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` for a contiguous ``x`` of shape ``[rows, cols]``."""
    rows, cols = x.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = _blocks(cols)
    kernel = launchable(_rms_norm_forward, x.device)
    kernel[(triton.cdiv(rows, block_m),)](
        x, weight, y, rstd, rows, cols, eps, block_m, block_n, num_warps=warps
    )
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    block_m, block_n, warps = _blocks(cols)
    tiles = triton.cdiv(rows, block_m)
    programs = min(tiles, _programs(x.device))
    dx = torch.empty_like(x)
    dw_parts = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    kernel = launchable(_rms_norm_backward, x.device)
    kernel[(programs,)](
        dy.contiguous(),
        x,
        weight,
        rstd,
        dx,
        dw_parts,
        rows,
        cols,
        tiles,
        programs,
        block_m,
        block_n,
        _backward_stages(tiles, programs),
        num_warps=warps,
    )
    return dx, dw_parts.sum(0).to(weight.dtype)


def _backward_stages(tiles: int, programs: int) -> int:
    if BACKWARD_STAGES is not None:
        return BACKWARD_STAGES
    return PIPELINED_STAGES if tiles >= PIPELINE_FROM_TILES_PER_PROGRAM * programs else 1


def _programs(device: torch.device) -> int:
    """Programs of the persistent backward: a few per SM (each keeps its weight-gradient sums in registers)."""
    if device.type != "cuda":
        return 4
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        y, rstd = rms_norm_forward(flat, weight.contiguous(), eps)
        ctx.save_for_backward(flat, weight, rstd)
        return y.view(*shape[:-1], shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        flat, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(flat.shape), flat, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be x's last dim ({x.shape[-1]},)")
    out: torch.Tensor = _RMSNorm.apply(x, weight, eps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalise(x)`` over the last dim: Triton on CUDA, the reference elsewhere (see
    :mod:`lightning_d9d.kernels.dispatch`)."""
    if use_triton("rms_norm", x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
