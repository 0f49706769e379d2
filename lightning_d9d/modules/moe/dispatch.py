"""Token dispatch: bring each token to the experts its router chose, and the experts' outputs back.

One interface, :class:`TokenDispatcher`, two calls around the experts::

    dispatched = dispatcher.dispatch(hidden, routing)        # rows grouped by (local) expert, and their weights
    out = experts(dispatched.tokens, dispatched.tokens_per_expert, dispatched.row_weights)
    hidden = dispatcher.combine(out, dispatched)             # [T, H], the sum over each token's top-k rows

The experts apply the routing weights (to each row's activation, before the down projection: ``down(w * h) =
w * down(h)``), so ``combine`` only sums. Weighing the narrow activation instead of the output makes the weights'
gradient a reduction over ``ffn`` on data the experts' SwiGLU backward reads anyway (fused with it under
``torch.compile``), where weighing the output needed the experts' whole ``[T * k, H]`` output kept for backward
and read again. Compiled blocks keep the experts' output less (``T * k * H`` elements a layer: 268 MB in bf16 at
the MoE benchmark shape, measured on CPU with ``benchmarks/saved_for_backward.py --model moe``; eager blocks keep
``T * k * (H - ffn)`` less), and the backward reads it no more.

Implementations:

- :class:`LocalDispatcher` (here): every expert is on this rank; permute, no communication.
- :class:`~lightning_d9d.modules.moe.AllToAllDispatcher`: all-to-all over the ``ep`` process group, the same two calls: ``dispatch`` permutes by
  global expert (experts ``r * E/ep ... (r+1) * E/ep - 1`` live on ``ep`` rank ``r``), exchanges the per-expert
  counts (``all_to_all_single``), sends the rows with ``all_to_all_single`` (split sizes from the counts), and
  re-sorts what arrived by local expert; ``tokens_per_expert`` then counts this rank's local experts over
  all source ranks. Each row's routing weight travels with it (one more ``all_to_all_single`` of ``N``
  scalars). ``combine`` runs the same steps backwards. The handle (:class:`Dispatched`) carries what the way
  back needs (split sizes, permutations).
- :class:`~lightning_d9d.modules.moe.DeepEPDispatcher`, when ``deep_ep`` is installed: its dispatch / combine
  calls fit the same two methods (see :mod:`lightning_d9d.modules.moe.deepep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_d9d.kernels import Permutation, permute_tokens, unpermute_tokens, weights_by_row
from lightning_d9d.modules.moe.router import Routing


@dataclass(frozen=True)
class Dispatched:
    """What ``dispatch`` hands the experts (``tokens [N, H]`` grouped by local expert, ``tokens_per_expert``
    one count per local expert, ``row_weights [N]`` each row's routing weight) and what ``combine`` needs back
    (``state``: the dispatcher's own handle)."""

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    row_weights: torch.Tensor
    state: Any


@runtime_checkable
class TokenDispatcher(Protocol):
    """Moves tokens to their experts and back; see the module docstring."""

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        """``hidden [T, H]`` and its routing -> rows grouped by local expert, with their routing weights."""
        ...

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' rows (same order as ``dispatched.tokens``, weighted by ``dispatched.row_weights``) ->
        ``[T, H]``, each token's rows summed."""
        ...


class LocalDispatcher:
    """All experts on this rank: a permutation by expert and its inverse (:mod:`lightning_d9d.kernels.permute`)."""

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        tokens, permutation = permute_tokens(
            hidden, routing.expert_indices, routing.tokens_per_expert.numel()
        )
        return Dispatched(
            tokens=tokens,
            tokens_per_expert=routing.tokens_per_expert,
            row_weights=weights_by_row(routing.expert_weights, permutation),
            state=permutation,
        )

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        permutation: Permutation = dispatched.state
        return unpermute_tokens(expert_output, permutation)


def local_expert_count(num_experts: int, ranks: int, group: str) -> int:
    """Experts each of ``ranks`` expert-parallel ranks holds (``num_experts / ranks``), for the dispatchers that
    split them; a ``num_experts`` that ``ranks`` does not divide is refused, naming both and ``group`` (what
    ``ranks`` counts) before any exchange starts."""
    if num_experts % ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by {group} ({ranks}): each ep rank holds the same "
            "number of experts; choose an ep that divides the number of experts"
        )
    return num_experts // ranks
