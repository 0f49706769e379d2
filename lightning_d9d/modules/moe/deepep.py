"""Expert-parallel token dispatch through DeepEP (``deep_ep.Buffer``: NVLink / RDMA kernels), when installed.

DeepEP sends each token once per destination *rank* (not once per expert) with its top-k indices, made local
(``-1`` where the expert lives elsewhere), and its top-k weights. The receiving rank groups the (token, local
expert) slots by expert, hands the experts each slot's weight (they weigh their rows) and sums a token's slots;
``Buffer.combine`` then sums each token's partial results over the ranks (an unweighted reduction). Backward
mirrors it: the gradient of dispatch is a combine with the forward's handle, the gradient of combine a dispatch
with it (DeepEP's documented pairing).

``deep_ep`` is optional: :func:`deep_ep_available` says whether it can be imported, and
:func:`~lightning_d9d.modules.moe.make_dispatcher` falls back to all-to-all with a log line when it cannot.
DeepEP's kernels take bf16 rows and fp32 weights; the expert count must divide by the group size.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_d9d.modules.moe.dispatch import Dispatched, local_expert_count
from lightning_d9d.modules.moe.router import Routing

# Intranode NVLink buffer size (bytes) when the caller gives none: enough for 4096 bf16 tokens of hidden 7168
# per rank at top-8 (DeepEP's test sizes); pass a Buffer of your own for other shapes.
DEFAULT_NVL_BYTES = 1 << 30


def deep_ep_available() -> bool:
    """Whether the ``deep_ep`` package can be imported (it is never an import error of ours)."""
    return importlib.util.find_spec("deep_ep") is not None


def new_deep_ep_buffer(group: dist.ProcessGroup, num_nvl_bytes: int = DEFAULT_NVL_BYTES) -> Any:
    """A ``deep_ep.Buffer`` for intranode dispatch over ``group`` (imports ``deep_ep``: check availability first)."""
    deep_ep = importlib.import_module("deep_ep")
    return deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, buffer: Any, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(indices, num_experts)
        recv_x, recv_indices, recv_weights, counts, handle, _ = buffer.dispatch(
            x,
            topk_idx=indices,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_indices)
        return recv_x, recv_weights, recv_indices, counts, handle

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, grad_weights: torch.Tensor | None, *_: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        grad_in, grad_in_weights, _ = ctx.buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_weights
        )
        return grad_in, grad_in_weights, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: Any, buffer: Any) -> torch.Tensor:
        combined, _, _ = buffer.combine(x, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_x, None, None


@dataclass(frozen=True)
class _DeepEPState:
    handle: Any
    received_tokens: int
    slot_order: torch.Tensor  # received slot (token * k + j) at grouped row i
    top_k: int


class DeepEPDispatcher:
    """The :class:`~lightning_d9d.modules.moe.TokenDispatcher` on a ``deep_ep.Buffer`` (see the module
    docstring). ``buffer``: one ``deep_ep.Buffer`` over the ``ep`` group, shared by every MoE layer."""

    def __init__(self, buffer: Any, num_experts: int) -> None:
        self.num_local_experts = local_expert_count(
            num_experts, int(buffer.group_size), "the DeepEP group size"
        )
        self.buffer = buffer
        self.num_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        weights = routing.expert_weights.float()
        recv_x, recv_weights, recv_indices, counts, handle = _Dispatch.apply(
            hidden, weights, routing.expert_indices, self.buffer, self.num_experts
        )
        top_k = recv_indices.shape[1]
        rows = int(sum(counts))
        # Slots of other ranks' experts (-1) sort last and are dropped; stable, so tokens keep their order.
        keys = recv_indices.reshape(-1).masked_fill(recv_indices.reshape(-1) < 0, self.num_local_experts)
        slot_order = torch.sort(keys, stable=True).indices[:rows]
        tokens = recv_x.index_select(0, torch.div(slot_order, top_k, rounding_mode="floor"))
        return Dispatched(
            tokens=tokens,
            tokens_per_expert=torch.tensor(counts, dtype=torch.int64, device=hidden.device),
            row_weights=recv_weights.reshape(-1)[slot_order],
            state=_DeepEPState(handle, recv_x.shape[0], slot_order, top_k),
        )

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        state: _DeepEPState = dispatched.state
        per_token = expert_output.new_zeros(state.received_tokens, expert_output.shape[1])
        per_token = per_token.index_add(
            0, torch.div(state.slot_order, state.top_k, rounding_mode="floor"), expert_output
        )
        result: torch.Tensor = _Combine.apply(per_token, state.handle, self.buffer)
        return result
