"""Expert-parallel token dispatch with ``all_to_all_single`` over the ``ep`` process group (gloo and NCCL).

Experts ``r * E/ep ... (r+1) * E/ep - 1`` live on ``ep`` rank ``r`` (dimension 0 of the stacked expert weights,
``Shard(0)`` over the ``ep`` mesh). ``dispatch``:

1. permutes this rank's token slots by global expert (:func:`~lightning_d9d.kernels.permute_tokens`), which
   also groups them by destination rank;
2. exchanges the per-expert counts (one small all-to-all), so each rank learns how many rows it receives from
   every source for each of its local experts;
3. sends the rows and each row's routing weight (all-to-alls with uneven split sizes: a host read of the
   counts, as every all-to-all dispatcher needs to size its buffers);
4. sorts what arrived (ordered by source, then local expert) by local expert, stably.

The experts weigh their rows; ``combine`` undoes 4, 3 and 1 and sums each token's rows on its own rank. The
all-to-alls are differentiable (backward is the reverse exchange), so gradients of expert inputs, of the
routing weights and of the weights of experts on other ranks flow like the local path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_d9d.kernels import Permutation, permute_tokens, unpermute_tokens, weights_by_row
from lightning_d9d.kernels.permute import group_by_expert
from lightning_d9d.modules.moe.dispatch import Dispatched, local_expert_count
from lightning_d9d.modules.moe.router import Routing


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with ``all_to_all_single``; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
    return received


@dataclass(frozen=True)
class _AllToAllState:
    permutation: Permutation  # this rank's slots by global expert
    order: torch.Tensor  # arrived row at grouped row i
    inverse: torch.Tensor  # grouped row of arrived row j
    send_splits: list[int]  # rows to each ep rank
    receive_splits: list[int]  # rows from each ep rank


class AllToAllDispatcher:
    """The :class:`~lightning_d9d.modules.moe.TokenDispatcher` for experts split over ``group`` (see the
    module docstring). ``num_experts`` is the global count; each rank holds ``num_experts / ep``."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        ep = dist.get_world_size(group)
        self.num_local_experts = local_expert_count(num_experts, ep, "ep")
        self.group = group
        self.ep = ep
        self.num_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        rows, permutation = permute_tokens(hidden, routing.expert_indices, self.num_experts)
        counts = routing.tokens_per_expert  # [E]: this rank's slots per global expert
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # received.view(ep, E_local)[s, e]: rows source rank s sends to this rank's local expert e
        by_source = received.view(self.ep, self.num_local_experts)
        splits = torch.cat([counts.view(self.ep, -1).sum(1), by_source.sum(1)]).tolist()
        send_splits, receive_splits = splits[: self.ep], splits[self.ep :]
        arrived = _AllToAll.apply(rows, receive_splits, send_splits, self.group)
        row_weights = weights_by_row(routing.expert_weights, permutation)
        arrived_weights = _AllToAll.apply(row_weights, receive_splits, send_splits, self.group)
        local_expert = torch.arange(self.num_local_experts, device=counts.device).repeat(self.ep)
        row_expert = local_expert.repeat_interleave(by_source.reshape(-1), output_size=arrived.shape[0])
        order, inverse = group_by_expert(row_expert, self.num_local_experts)
        return Dispatched(
            tokens=arrived.index_select(0, order),
            tokens_per_expert=by_source.sum(0),
            row_weights=arrived_weights.index_select(0, order),
            state=_AllToAllState(permutation, order, inverse, send_splits, receive_splits),
        )

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        state: _AllToAllState = dispatched.state
        arrived_order = expert_output.index_select(0, state.inverse)
        returned = _AllToAll.apply(arrived_order, state.send_splits, state.receive_splits, self.group)
        return unpermute_tokens(returned, state.permutation)
