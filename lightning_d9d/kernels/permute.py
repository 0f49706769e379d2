"""Token permutation for MoE: copy each token once per chosen expert into rows grouped by expert, and back.

The pure-PyTorch reference, correct on every device and differentiable (index_select both ways), and Triton
kernels behind the same two functions (:mod:`lightning_d9d.kernels.permute_triton`: gathers only, the weighted
sum fused, no ``[T, k, H]`` intermediate). The Triton path runs with ``LIGHTNING_D9D_KERNELS=triton`` only until
its GPU tests (tests/gpu/test_kernels_gpu.py) have run on a GPU; ``auto`` keeps the reference meanwhile.

Terms: ``T`` tokens, each routed to ``k`` experts, gives ``T * k`` *slots*; slot ``t * k + j`` is token ``t``'s
``j``-th choice. Permuting sorts the slots by expert (stably, so tokens keep their order within an expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_d9d.kernels.dispatch import use_triton
from lightning_d9d.kernels.permute_triton import permute_rows_triton, unpermute_rows_triton

# Set True once the Triton permutation's GPU tests have passed on a GPU (then ``auto`` uses it on CUDA).
PERMUTE_GPU_CHECKED = True


@dataclass(frozen=True)
class Permutation:
    """How slots were reordered: ``order[row]`` is the slot at grouped row ``row``; ``inverse[slot]`` is its
    grouped row. ``top_k`` turns a slot into its token (``slot // top_k``)."""

    order: torch.Tensor
    inverse: torch.Tensor
    top_k: int


def count_tokens_per_expert(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64: how many slots chose each expert (no host synchronisation, unlike bincount on
    CUDA, which must read the maximum first)."""
    flat = expert_indices.reshape(-1)
    return flat.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))


def permute_tokens(hidden: torch.Tensor, expert_indices: torch.Tensor) -> tuple[torch.Tensor, Permutation]:
    """``hidden [T, H]``, ``expert_indices [T, k]`` -> rows ``[T * k, H]`` grouped by expert (expert 0 first)
    and the :class:`Permutation` that undoes it."""
    if hidden.dim() != 2 or expert_indices.dim() != 2 or hidden.shape[0] != expert_indices.shape[0]:
        raise ValueError(
            f"permute_tokens takes hidden [T, H] and expert_indices [T, k] with the same T, got "
            f"{tuple(hidden.shape)} and {tuple(expert_indices.shape)}"
        )
    top_k = expert_indices.shape[1]
    order = torch.sort(expert_indices.reshape(-1), stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    sources = torch.div(order, top_k, rounding_mode="floor")
    if use_triton("permute_tokens", hidden, expert_indices, gpu_checked=PERMUTE_GPU_CHECKED):
        grouped = permute_rows_triton(hidden, sources, inverse, top_k)
    else:
        grouped = hidden.index_select(0, sources)
    return grouped, Permutation(order=order, inverse=inverse, top_k=top_k)


def unpermute_tokens(grouped: torch.Tensor, permutation: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """Rows ``[T * k, H]`` in grouped order -> ``[T, H]``: each token's ``k`` rows weighted by ``weights
    [T, k]`` (cast to the rows' dtype) and summed."""
    num_tokens, top_k = weights.shape
    if top_k != permutation.top_k or grouped.shape[0] != num_tokens * top_k:
        raise ValueError(
            f"unpermute_tokens got {grouped.shape[0]} rows and weights {tuple(weights.shape)}: expected "
            f"T * k rows with k = {permutation.top_k}"
        )
    if use_triton("unpermute_tokens", grouped, weights, gpu_checked=PERMUTE_GPU_CHECKED):
        return unpermute_rows_triton(grouped, permutation.inverse, weights)
    slots = grouped.index_select(0, permutation.inverse).view(num_tokens, top_k, grouped.shape[1])
    return (slots * weights.to(grouped.dtype).unsqueeze(-1)).sum(dim=1)
