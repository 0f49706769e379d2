"""Triton MoE token permutation: the gather into expert-grouped rows and the weighted gather back, with their
backward passes, for :mod:`lightning_d9d.kernels.permute` (which holds the references and picks).

Every pass is a gather, never a scatter with atomics: permuting copies row ``order[r] // k`` into row ``r``,
and its backward sums each token's ``k`` rows found through ``inverse``; unpermuting sums each token's ``k``
rows times their weights (fp32, rounded once), and its backward writes each grouped row once (the rows are a
permutation of the slots) and reduces each slot's weight gradient over the hidden dim.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.kernels.dispatch import launchable
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK_H = 1024


@triton.jit
def _gather_rows(SRC, IDX, DST, hidden, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(IDX + row).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        tl.store(DST + row * hidden + cols, tl.load(SRC + source * hidden + cols, mask=mask), mask=mask)


@triton.jit
def _weighted_gather_sum(  # type: ignore[no-untyped-def]
    SRC, IDX, W, DST, top_k, hidden, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in range(0, top_k):
            row = tl.load(IDX + token * top_k + j).to(tl.int64)
            x = tl.load(SRC + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                x = x * tl.load(W + token * top_k + j).to(tl.float32)
            acc += x
        tl.store(DST + token * hidden + cols, acc.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward(  # type: ignore[no-untyped-def]
    DOUT, GROUPED, IDX, W, DGROUPED, DW, top_k, hidden, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    slot = tl.program_id(0).to(tl.int64)
    token = slot // top_k
    row = tl.load(IDX + slot).to(tl.int64)
    weight = tl.load(W + slot).to(tl.float32)
    dot = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        dout = tl.load(DOUT + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(GROUPED + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DGROUPED + row * hidden + cols, (dout * weight).to(DGROUPED.dtype.element_ty), mask=mask)
        dot += dout * x
    tl.store(DW + slot, tl.sum(dot, axis=0))


def _block(hidden: int) -> int:
    return min(BLOCK_H, triton.next_power_of_2(hidden))


def _weighted_sum(
    src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    tokens = index.numel() // top_k
    out = torch.empty((tokens, src.shape[1]), dtype=src.dtype, device=src.device)
    launchable(_weighted_gather_sum, src.device)[(tokens,)](
        src, index, weights if weights is not None else src, out, top_k, src.shape[1], weights is not None,
        _block(src.shape[1]),
    )  # fmt: skip
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, sources: torch.Tensor, inverse: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        hidden = hidden.contiguous()
        grouped = torch.empty((sources.numel(), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        launchable(_gather_rows, hidden.device)[(sources.numel(),)](
            hidden, sources, grouped, hidden.shape[1], _block(hidden.shape[1])
        )
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return grouped

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return _weighted_sum(grad.contiguous(), inverse, None, ctx.top_k), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        grouped, weights = grouped.contiguous(), weights.contiguous()
        ctx.save_for_backward(grouped, inverse, weights)
        return _weighted_sum(grouped, inverse, weights, weights.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grouped, inverse, weights = ctx.saved_tensors
        d_grouped = torch.empty_like(grouped)
        d_weights = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
        launchable(_unpermute_backward, grouped.device)[(inverse.numel(),)](
            grad.contiguous(), grouped, inverse, weights, d_grouped, d_weights, weights.shape[1], grouped.shape[1],
            _block(grouped.shape[1]),
        )  # fmt: skip
        return d_grouped, None, d_weights.to(weights.dtype)


def permute_rows_triton(
    hidden: torch.Tensor, sources: torch.Tensor, inverse: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``hidden[sources]`` (``sources[r] = order[r] // top_k``); backward through ``inverse``."""
    out: torch.Tensor = _Permute.apply(hidden, sources, inverse, top_k)
    return out


def unpermute_rows_triton(
    grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[t, j] * grouped[inverse[t * k + j]]`` for every token ``t``."""
    out: torch.Tensor = _Unpermute.apply(grouped, inverse, weights)
    return out
