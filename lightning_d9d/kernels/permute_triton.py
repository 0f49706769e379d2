"""Triton MoE token permutation: the copy into expert-grouped rows and the weighted sum back, with their
backward passes, for :mod:`lightning_d9d.kernels.permute` (which holds the references and picks).

No pass scatters with atomics. Permuting is token-major: each token's row is read once and written to its ``k``
grouped rows ``inverse[t * k + j]`` (a permutation of the rows, so each is written once): on an H200 (16,384
tokens, top-8, hidden 1024) 86 us against 114 us for the gather it replaced, which read row ``order[r] // k``
for every grouped row ``r`` (``benchmarks/permute_candidates.py``). Its backward sums each token's ``k`` rows
found through ``inverse``; unpermuting sums each token's ``k`` rows times their weights (fp32, rounded once),
and its backward writes each grouped row once and reduces each slot's weight gradient over the hidden dim. A
token's ``k`` rows are read by ``k`` unrolled loads (``top_k`` is a compile-time constant) added into one fp32
accumulator, so no reduction crosses threads: on an H200 (inside ``torch.compile``) the unpermute forward took
0.42 ms this way against 0.54 ms summing one ``[k, BLOCK]`` tile, the variant it replaced.

Where the experts weighed their rows already (the MoE block's way: :func:`~lightning_d9d.kernels.permute.
weights_by_row`), the way back is an unweighted sum (``sum_rows``) whose backward is the permutation's own copy
of each token's gradient into its rows: nothing of the rows is kept for it.

The passes are torch custom operators (``lightning_d9d::permute_rows`` / ``unpermute_rows`` / ``sum_rows``,
autograd registered), so ``torch.compile`` calls them as they are instead of tracing the reference: Inductor's own
kernels for these index gathers ran at about a fifth of the copy bandwidth on an H200.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.kernels.dispatch import announce, launchable
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK_H = 1024
# 4 warps give a 1024-wide bf16 row 8 elements (one 16-byte load) per thread.
WARPS = 4


@triton.jit
def _spread_rows(  # type: ignore[no-untyped-def]
    SRC, INVERSE, DST, tokens, hidden, TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    token = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token_mask = token < tokens
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = token_mask[:, None] & (cols < hidden)[None, :]
        values = tl.load(SRC + token[:, None] * hidden + cols[None, :], mask=mask)
        for j in tl.static_range(TOP_K):
            row = tl.load(INVERSE + token * TOP_K + j, mask=token_mask, other=0).to(tl.int64)
            tl.store(DST + row[:, None] * hidden + cols[None, :], values, mask=mask)


@triton.jit
def _weighted_gather_sum(  # type: ignore[no-untyped-def]
    SRC, IDX, W, DST, hidden, TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(IDX + token * TOP_K + j).to(tl.int64)
        x = tl.load(SRC + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            x = x * tl.load(W + token * TOP_K + j).to(tl.float32)
        acc += x
    tl.store(DST + token * hidden + cols, acc.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward(  # type: ignore[no-untyped-def]
    DOUT, GROUPED, IDX, W, DGROUPED, DW, hidden, TOP_K: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    token = tl.program_id(0).to(tl.int64)
    choice = tl.arange(0, K)
    dot = tl.zeros((K,), tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        dout = tl.load(DOUT + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(IDX + token * TOP_K + j).to(tl.int64)
            weight = tl.load(W + token * TOP_K + j).to(tl.float32)
            x = tl.load(GROUPED + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DGROUPED + row * hidden + cols, (dout * weight).to(DGROUPED.dtype.element_ty), mask=mask)
            dot += tl.where(choice == j, tl.sum(dout * x, axis=0), 0.0)
    tl.store(DW + token * TOP_K + choice, dot, mask=choice < TOP_K)


# The ops below that an MoE layer's forward calls (permute_rows, sum_rows, unpermute_rows) launch their kernels
# through these plain functions, not through the spread_rows / weighted_gather_sum ops: a second custom-op dispatch
# costs the host a few microseconds a call, and an MoE layer's many short launches are where a small step waits
# for the host (docs/benchmarks.md, run U9: CUDA graphs make the MoE step 3x faster at 1024 tokens). The two ops
# exist for the autograd formulas, which compile traces and which must call ops.
def _spread(source: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    source = source.contiguous()
    tokens, width = source.shape
    spread = torch.empty((tokens * top_k, width), dtype=source.dtype, device=source.device)
    block = min(BLOCK_H, triton.next_power_of_2(width))
    launchable(_spread_rows, source.device)[(tokens,)](
        source, inverse.contiguous(), spread, tokens, width, top_k, 1, block, num_warps=WARPS
    )
    return spread


def _gather_sum(
    src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    src = src.contiguous()
    tokens, width = index.numel() // top_k, src.shape[1]
    out = torch.empty((tokens, width), dtype=src.dtype, device=src.device)
    w = weights.contiguous() if weights is not None else src
    block = min(BLOCK_H, triton.next_power_of_2(width))
    launchable(_weighted_gather_sum, src.device)[(tokens, triton.cdiv(width, block))](
        src, index.contiguous(), w, out, width, top_k, weights is not None, block, num_warps=WARPS
    )
    return out


@torch.library.custom_op("lightning_d9d::spread_rows", mutates_args=())
def spread_rows(source: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows ``[T * top_k, H]``: token ``t``'s row of ``source [T, H]`` copied to rows ``inverse[t * top_k + j]``
    for each ``j`` (``inverse`` a permutation of the rows, so each is written once)."""
    return _spread(source, inverse, top_k)


@spread_rows.register_fake
def _(source: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    return source.new_empty((source.shape[0] * top_k, source.shape[1]))


@torch.library.custom_op("lightning_d9d::permute_rows", mutates_args=())
def permute_rows(hidden: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's row of ``hidden`` copied to its ``top_k`` grouped rows (``inverse``); the backward sums them
    back through ``inverse``."""
    announce("permute_tokens")
    return _spread(hidden, inverse, top_k)


@permute_rows.register_fake
def _(hidden: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0] * top_k, hidden.shape[1]))


@torch.library.custom_op("lightning_d9d::weighted_gather_sum", mutates_args=())
def weighted_gather_sum(
    src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[index[t * top_k + j]]`` (weights 1 when None), summed in fp32."""
    return _gather_sum(src, index, weights, top_k)


@weighted_gather_sum.register_fake
def _(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, top_k: int) -> torch.Tensor:
    return src.new_empty((index.numel() // top_k, src.shape[1]))


@torch.library.custom_op("lightning_d9d::unpermute_backward", mutates_args=())
def unpermute_backward(
    grad: torch.Tensor, grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`unpermute_rows`: the grouped rows' (``grad`` of each row's token times its weight)
    and the weights' (fp32: each slot's row dotted with its token's gradient)."""
    grouped, weights = grouped.contiguous(), weights.contiguous()
    d_grouped = torch.empty_like(grouped)
    d_weights = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
    top_k, width = weights.shape[1], grouped.shape[1]
    k, block = triton.next_power_of_2(top_k), min(BLOCK_H, triton.next_power_of_2(width))
    launchable(_unpermute_backward, grouped.device)[(weights.shape[0],)](
        grad.contiguous(), grouped, inverse.contiguous(), weights, d_grouped, d_weights, width, top_k, k, block,
        num_warps=WARPS,
    )  # fmt: skip
    return d_grouped, d_weights


@unpermute_backward.register_fake
def _(
    grad: torch.Tensor, grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(grouped), weights.new_empty(weights.shape, dtype=torch.float32)


@torch.library.custom_op("lightning_d9d::unpermute_rows", mutates_args=())
def unpermute_rows(grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * grouped[inverse[t * k + j]]`` for every token ``t``."""
    announce("unpermute_tokens")
    return _gather_sum(grouped, inverse, weights, weights.shape[1])


@unpermute_rows.register_fake
def _(grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return grouped.new_empty((weights.shape[0], grouped.shape[1]))


@torch.library.custom_op("lightning_d9d::sum_rows", mutates_args=())
def sum_rows(grouped: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``sum_j grouped[inverse[t * k + j]]`` for every token ``t`` (rows the experts weighed already); its backward
    hands each grouped row its token's gradient (the permutation's own copy, :func:`spread_rows`)."""
    announce("unpermute_tokens")
    return _gather_sum(grouped, inverse, None, top_k)


@sum_rows.register_fake
def _(grouped: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    return grouped.new_empty((grouped.shape[0] // top_k, grouped.shape[1]))


def _permute_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.top_k = inputs[2]


def _permute_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (inverse,) = ctx.saved_tensors
    return weighted_gather_sum(grad, inverse, None, ctx.top_k), None, None


def _unpermute_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    grouped, inverse, weights = inputs
    ctx.save_for_backward(grouped, inverse, weights)


def _unpermute_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    grouped, inverse, weights = ctx.saved_tensors
    d_grouped, d_weights = unpermute_backward(grad, grouped, inverse, weights)
    return d_grouped, None, d_weights.to(weights.dtype)


def _sum_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.top_k = inputs[2]


def _sum_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (inverse,) = ctx.saved_tensors
    return spread_rows(grad, inverse, ctx.top_k), None, None


permute_rows.register_autograd(_permute_grad, setup_context=_permute_context)
sum_rows.register_autograd(_sum_grad, setup_context=_sum_context)
unpermute_rows.register_autograd(_unpermute_grad, setup_context=_unpermute_context)


def permute_rows_triton(hidden: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's row copied to its ``top_k`` grouped rows (``inverse``); backward through ``inverse``."""
    out: torch.Tensor = permute_rows(hidden, inverse, top_k)
    return out


def unpermute_rows_triton(
    grouped: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[t, j] * grouped[inverse[t * k + j]]`` for every token ``t``."""
    out: torch.Tensor = unpermute_rows(grouped, inverse, weights)
    return out


def sum_rows_triton(grouped: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``sum_j grouped[inverse[t * k + j]]`` for every token ``t``; backward copies through ``inverse``."""
    out: torch.Tensor = sum_rows(grouped, inverse, top_k)
    return out
