"""Token permutation for MoE: copy each token once per chosen expert into rows grouped by expert, and back.

The pure-PyTorch reference, correct on every device, and Triton kernels behind the same two functions
(:mod:`lightning_d9d.kernels.permute_triton`: gathers only, the weighted sum fused, no ``[T, k, H]``
intermediate). The Triton path runs on CUDA in eager mode (its GPU tests, tests/gpu/test_kernels_gpu.py, have
passed), inside ``torch.compile`` too (they are custom operators); where the reference runs, its backward is a
gather too (:class:`_GatherRows`):
``index_select``'s own backward is ``index_add``, a scatter with atomics (bf16 on the GPU: slow, and its
summation order varies run to run), whereas both permutations here can be undone by reading through the
inverse map: each token's gradient is its ``k`` slots' gradients read through ``inverse`` and summed.

Terms: ``T`` tokens, each routed to ``k`` experts, gives ``T * k`` *slots*; slot ``t * k + j`` is token ``t``'s
``j``-th choice. Permuting sorts the slots by expert (stably, so tokens keep their order within an expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_d9d.kernels.dispatch import use_triton
from lightning_d9d.kernels.permute_triton import permute_rows_triton, sum_rows_triton, unpermute_rows_triton

# Set True once the Triton permutation's GPU tests have passed on a GPU (then ``auto`` uses it on CUDA).
PERMUTE_GPU_CHECKED = True


@dataclass(frozen=True)
class Permutation:
    """How slots were reordered: ``order[row]`` is the slot at grouped row ``row``; ``inverse[slot]`` is its
    grouped row. ``top_k`` turns a slot into its token (``slot // top_k``)."""

    order: torch.Tensor
    inverse: torch.Tensor
    top_k: int


class _GatherRows(torch.autograd.Function):
    """``source[index]`` whose backward gathers too: row ``i`` of ``source`` was copied to the ``fold`` rows
    ``back_index[i * fold : (i + 1) * fold]`` of the output (and nowhere else), so its gradient is those rows
    of the output's gradient, summed. Exact, unlike a scatter-add in no fixed order. Plain torch ops, so
    Dynamo traces it into the compiled graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, source: torch.Tensor, index: torch.Tensor, back_index: torch.Tensor, fold: int
    ) -> torch.Tensor:
        ctx.save_for_backward(back_index)
        ctx.fold = fold
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (back_index,) = ctx.saved_tensors
        rows = grad.index_select(0, back_index)
        if ctx.fold > 1:
            rows = rows.view(-1, ctx.fold, grad.shape[1]).sum(dim=1)
        return rows, None, None, None


def _gather_rows(
    source: torch.Tensor, index: torch.Tensor, back_index: torch.Tensor, fold: int
) -> torch.Tensor:
    out: torch.Tensor = _GatherRows.apply(source, index, back_index, fold)
    return out


def count_tokens_per_expert(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64: how many slots chose each expert (no host synchronisation, unlike bincount on
    CUDA, which must read the maximum first)."""
    flat = expert_indices.reshape(-1)
    return flat.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))


def sort_key(expert_ids: torch.Tensor, num_experts: int | None) -> torch.Tensor:
    """``expert_ids`` as int16 when ``num_experts`` says they fit: the GPU's radix sort makes one pass per digit
    of the key's width, so int64 ids (top-k's dtype) take four times the passes of int16 for the same stable
    order. Unchanged when the count is not known (reading the maximum would wait for the GPU)."""
    if num_experts is not None and num_experts <= torch.iinfo(torch.int16).max + 1:
        return expert_ids.to(torch.int16)
    return expert_ids


def group_by_expert(expert_ids: torch.Tensor, num_experts: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)`` of a stable sort of ``expert_ids [N]``: ``order`` lists the positions expert by expert
    (in their original order within an expert), ``inverse[order[i]] == i``. ``num_experts`` (the ids are below
    it; ``None`` if unknown) lets the sort use narrow keys (:func:`sort_key`)."""
    order = torch.sort(sort_key(expert_ids, num_experts), stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse


def permute_tokens(
    hidden: torch.Tensor, expert_indices: torch.Tensor, num_experts: int | None = None
) -> tuple[torch.Tensor, Permutation]:
    """``hidden [T, H]``, ``expert_indices [T, k]`` -> rows ``[T * k, H]`` grouped by expert (expert 0 first)
    and the :class:`Permutation` that undoes it. ``num_experts`` (the ids are below it), when given, lets the
    sort use narrower keys."""
    if hidden.dim() != 2 or expert_indices.dim() != 2 or hidden.shape[0] != expert_indices.shape[0]:
        raise ValueError(
            f"permute_tokens takes hidden [T, H] and expert_indices [T, k] with the same T, got "
            f"{tuple(hidden.shape)} and {tuple(expert_indices.shape)}"
        )
    top_k = expert_indices.shape[1]
    order, inverse = group_by_expert(expert_indices.reshape(-1), num_experts)
    if use_triton("permute_tokens", hidden, expert_indices, gpu_checked=PERMUTE_GPU_CHECKED, traceable=True):
        grouped = permute_rows_triton(hidden, inverse, top_k)
    else:
        # Token t's k slots sit at grouped rows inverse[t * k : (t + 1) * k].
        grouped = _gather_rows(hidden, torch.div(order, top_k, rounding_mode="floor"), inverse, top_k)
    return grouped, Permutation(order=order, inverse=inverse, top_k=top_k)


def weights_by_row(weights: torch.Tensor, permutation: Permutation) -> torch.Tensor:
    """``weights [T, k]`` (one per slot) -> ``[T * k]`` in grouped order: row ``r``'s weight is its slot's,
    ``weights.reshape(-1)[order[r]]``; its backward reads through ``inverse`` (no scatter)."""
    column = _gather_rows(weights.reshape(-1, 1), permutation.order, permutation.inverse, 1)
    return column.reshape(-1)


def weigh_rows(rows: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    """``rows [N, width]`` times each row's weight (:func:`weights_by_row`, cast to the rows' dtype; ``rows``
    unchanged when ``None``): how experts weigh their activations before an unweighted :func:`unpermute_tokens`."""
    if row_weights is None:
        return rows
    return rows * row_weights.to(rows.dtype).unsqueeze(-1)


def unpermute_tokens(
    grouped: torch.Tensor, permutation: Permutation, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``[T * k, H]`` in grouped order -> ``[T, H]``: each token's ``k`` rows weighted by ``weights
    [T, k]`` (cast to the rows' dtype) and summed; without ``weights``, summed as they are (rows the experts
    weighed already: :func:`weights_by_row`)."""
    top_k = permutation.top_k
    num_tokens = grouped.shape[0] // top_k
    if grouped.shape[0] != num_tokens * top_k or (
        weights is not None and tuple(weights.shape) != (num_tokens, top_k)
    ):
        got = "" if weights is None else f" and weights {tuple(weights.shape)}"
        raise ValueError(
            f"unpermute_tokens got {grouped.shape[0]} rows{got}: expected T * k rows (and weights [T, k]) with "
            f"k = {top_k}"
        )
    tensors = (grouped,) if weights is None else (grouped, weights)
    if use_triton("unpermute_tokens", *tensors, gpu_checked=PERMUTE_GPU_CHECKED, traceable=True):
        if weights is not None:
            return unpermute_rows_triton(grouped, permutation.inverse, weights)
        return sum_rows_triton(grouped, permutation.inverse, top_k)
    # Grouped row r holds slot order[r]: reading the slots' gradients through order undoes the gather.
    slots = _gather_rows(grouped, permutation.inverse, permutation.order, 1)
    slots = slots.view(num_tokens, top_k, grouped.shape[1])
    if weights is None:
        return slots.sum(dim=1)
    return (slots * weights.to(grouped.dtype).unsqueeze(-1)).sum(dim=1)
