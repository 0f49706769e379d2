"""Token permutation: rows grouped by expert in a stable order, and the weighted way back equals a loop."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.kernels import (
    count_tokens_per_expert,
    permute_tokens,
    unpermute_tokens,
    weigh_rows,
    weights_by_row,
)
from lightning_d9d.kernels.permute import sort_key


def test_permute_groups_slots_by_expert_stably() -> None:
    hidden = torch.arange(4.0).unsqueeze(1).repeat(1, 2)  # token t is the row [t, t]
    indices = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 1]])
    grouped, permutation = permute_tokens(hidden, indices)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 2, 3; expert 2: tokens 0, 1, 2 (token order kept)
    assert grouped[:, 0].tolist() == [0, 1, 3, 2, 3, 0, 1, 2]
    assert count_tokens_per_expert(indices, 4).tolist() == [3, 2, 3, 0]
    assert permutation.order.tolist() == [1, 2, 6, 5, 7, 0, 3, 4]  # slots t * k + j


def test_narrow_sort_keys_keep_the_order() -> None:
    """Given the expert count, the ids sort as int16 (fewer radix passes on a GPU) into the same stable order;
    a count past int16 keeps the ids as they are."""
    generator = torch.Generator().manual_seed(5)
    experts = 32768
    indices = torch.randint(0, experts, (4096, 4), generator=generator)
    indices[::7] = torch.tensor([experts - 1, 0, 5, 5])  # the top id and repeats, whose order must hold
    hidden = torch.randn(4096, 3, generator=generator)
    assert sort_key(indices, experts).dtype == torch.int16
    assert sort_key(indices, experts + 1).dtype == torch.int64
    grouped, permutation = permute_tokens(hidden, indices, experts)
    expected_grouped, expected = permute_tokens(hidden, indices)
    assert torch.equal(permutation.order, expected.order) and torch.equal(grouped, expected_grouped)


def test_unpermute_is_the_weighted_sum_over_each_tokens_choices() -> None:
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size, top_k, experts = 7, 5, 3, 6
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    scale = torch.randn(experts, hidden_size, generator=generator)  # a per-expert "expert": x * scale[e]

    grouped, permutation = permute_tokens(hidden, indices)
    sorted_experts = indices.reshape(-1)[permutation.order]
    out = unpermute_tokens(grouped * scale[sorted_experts], permutation, weights)

    expected = torch.zeros(tokens, hidden_size)
    for token in range(tokens):
        for choice in range(top_k):
            expert = int(indices[token, choice])
            expected[token] += weights[token, choice] * hidden[token] * scale[expert]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def _routed(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden_size, top_k, experts = 9, 4, 3, 5
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    # Expert 4 never chosen: an empty group.
    indices = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    scale = torch.randn(experts, hidden_size, generator=generator, dtype=torch.float64)
    return hidden, indices, weights, scale


def _moe_like(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, weighed: str
) -> torch.Tensor:
    """permute -> a per-expert scaling -> unpermute; the weights applied by unpermute (``weighed="combine"``) or
    to each grouped row before an unweighted sum (``"rows"``, what the MoE block's experts do)."""
    grouped, permutation = permute_tokens(hidden, indices)
    expert_rows = grouped * scale[indices.reshape(-1)[permutation.order]]
    if weighed == "rows":
        return unpermute_tokens(weigh_rows(expert_rows, weights_by_row(weights, permutation)), permutation)
    return unpermute_tokens(expert_rows, permutation, weights)


WEIGHED = ("combine", "rows")


@pytest.mark.parametrize("weighed", WEIGHED)
def test_permutation_gradients_equal_the_loops_gradients_eager_and_traced(weighed: str) -> None:
    """Both backward gathers (token <- its k slots, grouped rows <- slots) against autograd through a loop that
    never permutes; also traced whole by Dynamo (``fullgraph``), as inside the compiled decoder layers."""
    hidden, indices, weights, scale = _routed(torch.Generator().manual_seed(5))
    upstream = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def loop(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = [
            sum(w[t, j] * h[t] * scale[indices[t, j]] for j in range(indices.shape[1]))
            for t in range(h.shape[0])
        ]
        return torch.stack(rows)  # type: ignore[arg-type]

    def grads(fn: object) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        (fn(h, w) * upstream).sum().backward()  # type: ignore[operator]
        assert h.grad is not None and w.grad is not None
        return h.grad, w.grad

    expected = grads(loop)
    eager = grads(lambda h, w: _moe_like(h, indices, w, scale, weighed))
    traced = grads(
        torch.compile(
            lambda h, w: _moe_like(h, indices, w, scale, weighed), backend="aot_eager", fullgraph=True
        )
    )
    for got in (eager, traced):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("weighed", WEIGHED)
def test_permutation_backward_has_no_scatter_add(weighed: str) -> None:
    """The reference's backward reads through the inverse permutation: no ``index_add`` (a scatter with atomics
    on the GPU, in no fixed order), which is what ``index_select``'s own backward would run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    hidden, indices, weights, scale = _routed(torch.Generator().manual_seed(7))
    hidden.requires_grad_()
    weights.requires_grad_()
    out = _moe_like(hidden, indices, weights, scale, weighed)
    with Ops() as ops:
        out.sum().backward()
    assert "index_select" in ops.seen
    assert (
        not {"index_add", "index_add_", "index_put", "index_put_", "scatter_add", "scatter_add_"} & ops.seen
    ), ops.seen
