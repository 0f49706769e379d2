"""Expert-tensor parallelism: every tp rank holds ``1/tp`` of every expert and runs the tokens of all tp ranks.

Under sequence parallelism each tp rank routes its own positions (:mod:`lightning_d9d.plans.routing`). With the
experts split over tp (:func:`~lightning_d9d.plans.expert_tensor.split_experts_over_tp`: each expert's gate and up
columns and its down rows ``1/tp`` per rank, Megatron's expert-tensor parallelism), a token needs every tp rank's
part of its experts, so :class:`ExpertTensorParallelDispatcher` wraps the block's dispatcher:

- ``dispatch``: this rank's tokens and their routing (each rank routed its own) are all-gathered over tp, and the
  wrapped dispatcher groups the tp group's rows by expert: every tp rank holds the same rows;
- the experts run them through their shards: the gate/up GEMM gives this rank's ``ffn / tp`` columns of each
  row, the down GEMM a partial sum over them (``[rows, hidden]``, a ``1/tp`` share of each row's output);
- ``combine``: the wrapped dispatcher sums each token's rows (still partial), and a reduce-scatter over tp adds
  up the tp ranks' partial sums and hands each rank its own tokens back.

Backward runs the conjugates: the partial outputs' gradient is the all-gather of the tokens' (every rank's partial
sum counts whole), and the gathered tokens' and routing weights' gradients, partial on every rank, are summed by a
reduce-scatter to the rank that routed them. The router, its losses and the shared experts see this rank's
tokens only, as without the split.

Communication per MoE layer and forward: one all-gather of ``[T, hidden]`` (plus the ``[T, k]`` routing indices
and weights) and one reduce-scatter of ``[T, hidden]`` over tp, for the ``T`` tokens of the tp group; backward the
same two the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_d9d.kernels import count_tokens_per_expert
from lightning_d9d.modules.moe.dispatch import Dispatched, TokenDispatcher
from lightning_d9d.modules.moe.router import Routing


@dataclass(frozen=True)
class _Gathered:
    """The wrapped dispatcher's handle, for ``combine``."""

    inner: Dispatched


class ExpertTensorParallelDispatcher:
    """Wraps ``inner`` (the local dispatcher: every expert on this rank, as ``1/tp`` shards) with the all-gather
    over ``tp`` (a 1-D mesh) before it and the reduce-scatter after it (see the module docstring). Every tp rank
    must bring as many tokens (sequence parallelism gives each the same share)."""

    def __init__(self, inner: TokenDispatcher, tp: DeviceMesh) -> None:
        if tp.ndim != 1:
            raise ValueError(f"expert-tensor parallelism takes a 1-D tp mesh, got {tp.ndim} dims")
        self.inner = inner
        self.tp = tp

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        num_experts = routing.tokens_per_expert.numel()
        indices = gather_tokens(routing.expert_indices, self.tp)
        empty = routing.expert_weights.new_empty(
            0
        )  # the router's logits and probabilities: no dispatcher reads them
        gathered = Routing(
            expert_indices=indices,
            expert_weights=gather_tokens(routing.expert_weights, self.tp),
            tokens_per_expert=count_tokens_per_expert(indices, num_experts),
            logits=empty,
            probs=empty,
        )
        inner = self.inner.dispatch(gather_tokens(hidden, self.tp), gathered)
        return Dispatched(inner.tokens, inner.tokens_per_expert, inner.row_weights, _Gathered(inner))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        handle: _Gathered = dispatched.state
        partial = self.inner.combine(expert_output, handle.inner)
        return sum_and_scatter_tokens(partial, self.tp)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, tp={self.tp.size()})"


def gather_tokens(local: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """Every tp rank's ``local [T, ...]`` concatenated in rank order (``[tp * T, ...]``); in backward the gradient,
    a partial sum on every rank, is reduce-scattered back (summed, each rank its own ``T`` rows)."""
    whole = DTensor.from_local(local, tp, [Shard(0)], run_check=False).redistribute(tp, [Replicate()])
    return whole.to_local(grad_placements=[Partial()])


def sum_and_scatter_tokens(partial: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """``partial [tp * T, ...]``, this rank's share of a sum over tp, summed over tp with each rank keeping its
    own ``T`` rows (a reduce-scatter); in backward the rows' gradients are all-gathered (every share counts
    whole)."""
    summed = DTensor.from_local(partial, tp, [Partial()], run_check=False).redistribute(tp, [Shard(0)])
    return summed.to_local()
