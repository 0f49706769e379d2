"""Expert-parallel dispatchers against the local one: outputs and every gradient equal.

All-to-all on 2 and 4 gloo ranks, each rank with its own number of tokens, some experts (on 4 ranks: a whole
rank's experts) chosen by no token. DeepEP through a fake one-rank ``Buffer`` that follows DeepEP's documented
contract (so the glue around it, not DeepEP, is what is tested here; DeepEP itself needs two GPUs).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_d9d.modules.moe import (
    AllToAllDispatcher,
    DeepEPDispatcher,
    MoE,
    expert_parallel_dispatcher,
)

EXPERTS, TOP_K, HIDDEN, FFN = 8, 2, 12, 6
UNCHOSEN = (5, 6, 7)  # with ep=4 rank 3 holds 6 and 7: it receives no row at all


def _block(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(HIDDEN, EXPERTS, TOP_K, FFN, normalize_top_k=True, selection_bias=True)
    assert block.gate.expert_bias is not None
    block.gate.expert_bias[list(UNCHOSEN)] = -1e3  # the bias only chooses: these experts get no token
    return block


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    count = 3 + 4 * rank  # uneven over the ranks
    hidden = torch.randn(count, HIDDEN, generator=generator)
    return hidden, torch.randn(count, HIDDEN, generator=generator)


def _run(block: MoE, hidden: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = hidden.clone().requires_grad_(True)
    output = block(hidden)
    (output * probe).sum().backward()
    assert hidden.grad is not None
    return output.detach(), hidden.grad


def _expert_parallel_equals_local() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = _block(), _block()
    local = EXPERTS // world
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(sharded.experts, name)
        setattr(sharded.experts, name, torch.nn.Parameter(full.detach()[rank * local : (rank + 1) * local]))
    sharded.dispatcher = AllToAllDispatcher(dist.group.WORLD, EXPERTS)
    hidden, probe = _tokens(rank)
    expected_out, expected_grad = _run(reference, hidden, probe)
    out, grad = _run(sharded, hidden, probe)
    errors = {
        "output": (out - expected_out).abs().max().item(),
        "input grad": (grad - expected_grad).abs().max().item(),
    }
    errors["router grad"] = (sharded.gate.weight.grad - reference.gate.weight.grad).abs().max().item()
    for name in ("gate_up_proj", "down_proj"):
        # an expert's gradient sums the tokens of every rank: the reference's gradients summed over the ranks
        expected = getattr(reference.experts, name).grad.clone()
        dist.all_reduce(expected)
        actual = getattr(sharded.experts, name).grad
        errors[name] = (actual - expected[rank * local : (rank + 1) * local]).abs().max().item()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_equals_local_dispatch(world: int) -> None:
    for rank, errors in enumerate(run_distributed(_expert_parallel_equals_local, world)):
        worst = max(errors.values())
        assert worst <= 1e-6, f"rank {rank}: {errors}"


def test_ep_must_divide_the_experts() -> None:
    def refuse() -> str:
        try:
            AllToAllDispatcher(dist.group.WORLD, 5)
        except ValueError as error:
            return str(error)
        return "accepted"

    assert "num_experts (5) must be divisible by ep (2)" in run_distributed(refuse, 2)[0]


# ------------------------------------------------------------------------------------------------ DeepEP
class FakeBuffer:
    """One rank's ``deep_ep.Buffer`` (intranode, no other rank): what DeepEP's docstrings promise for
    ``get_dispatch_layout`` / ``dispatch`` / ``combine``, computed with torch. Every expert is local, and no
    index is ``-1`` unless the caller sends one."""

    group_size = 1

    def __init__(self) -> None:
        self.calls: list[str] = []

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[Any, ...]:
        self.calls.append("layout")
        assert topk_idx.dtype == torch.int64
        per_expert = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).int()
        per_rank = torch.tensor([topk_idx.shape[0]], dtype=torch.int)
        in_rank = torch.ones(topk_idx.shape[0], 1, dtype=torch.bool)
        return per_rank, None, per_expert, in_rank, None

    def dispatch(self, x: torch.Tensor, handle: Any = None, **kwargs: Any) -> tuple[Any, ...]:
        self.calls.append("dispatch" if handle is None else "dispatch(handle)")
        if handle is not None:  # cached layout: only x travels (the backward of combine)
            return x.clone(), None, None, None, None, None
        weights = kwargs["topk_weights"]
        assert weights.dtype == torch.float32
        counts = kwargs["num_tokens_per_expert"].tolist()
        return x.clone(), kwargs["topk_idx"].clone(), weights.clone(), counts, ("handle",), None

    def combine(
        self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None
    ) -> tuple[Any, ...]:
        self.calls.append("combine")
        assert handle == ("handle",)
        return x.clone(), None if topk_weights is None else topk_weights.clone(), None


def test_deepep_dispatcher_equals_local_dispatch_with_a_fake_buffer() -> None:
    reference, block = _block(), _block()
    buffer = FakeBuffer()
    block.dispatcher = DeepEPDispatcher(buffer, EXPERTS)
    hidden, probe = _tokens(2)
    expected_out, expected_grad = _run(reference, hidden, probe)
    out, grad = _run(block, hidden, probe)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(block.gate.weight.grad, reference.gate.weight.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        block.experts.down_proj.grad, reference.experts.down_proj.grad, rtol=0, atol=1e-6
    )
    # backward used DeepEP's pairing: combine's gradient is a cached dispatch, dispatch's a combine
    assert buffer.calls == ["layout", "dispatch", "combine", "dispatch(handle)", "combine"]


def test_missing_deep_ep_falls_back_to_all_to_all(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_d9d.modules.moe.choose as choose

    monkeypatch.setattr(choose, "deep_ep_available", lambda: False)

    def pick() -> str:
        with caplog.at_level(logging.WARNING, logger="lightning_d9d.moe"):
            return type(expert_parallel_dispatcher(dist.group.WORLD, EXPERTS, backend="deepep")).__name__

    # one process group of one rank is enough to build a dispatcher
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert pick() == "AllToAllDispatcher"
        assert "deep_ep is not installed; falling back to all_to_all" in caplog.text
        with pytest.raises(ValueError, match="unknown MoE dispatch backend 'nccl'"):
            expert_parallel_dispatcher(dist.group.WORLD, EXPERTS, backend="nccl")
    finally:
        dist.destroy_process_group()
