"""Activation checkpointing must recompute exactly what forward computed, random ops included (defect 7), and
selective checkpointing must recompute the element-wise ops only."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.plans import apply_activation_checkpointing


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dropout(self.linear(x)))


def gradients(blocks: nn.ModuleList, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # the same dropout masks for every model that runs under this seed
    for block in blocks:
        x = block(x)
    (x * x).sum().backward()
    grads = {}
    for name, param in blocks.named_parameters():
        assert param.grad is not None, name
        grads[name.replace("._checkpoint_wrapped_module", "")] = param.grad
    return grads


@pytest.mark.parametrize("preserve_rng_state", [None, True, False])
def test_dropout_gradients_match_the_unwrapped_blocks(preserve_rng_state: bool | None) -> None:
    torch.manual_seed(0)
    plain = nn.ModuleList([DropoutBlock(), DropoutBlock()])
    wrapped = copy.deepcopy(plain)
    if preserve_rng_state is None:  # the default must be the safe choice
        apply_activation_checkpointing(wrapped)
    else:
        apply_activation_checkpointing(wrapped, preserve_rng_state=preserve_rng_state)
    x = torch.randn(8, 16)
    expected, actual = gradients(plain, x), gradients(wrapped, x)
    assert expected.keys() == actual.keys()
    if preserve_rng_state is False:
        # Recompute draws new dropout masks: the gradients are wrong. This case shows the test can fail.
        assert any(not torch.allclose(actual[name], expected[name]) for name in expected)
    else:
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=0, atol=0, msg=name)


class CountOps(TorchDispatchMode):
    """How many times each aten op runs inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(kind: str | None) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """Gradients of a tiny Qwen3 (its decoder layers checkpointed as ``kind``) and the ops its backward ran."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    if kind is not None:
        apply_activation_checkpointing(model.model.layers, preserve_rng_state=False, kind=kind)  # type: ignore[arg-type]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(ids).float().logsumexp(-1).mean()
    counter = CountOps()
    with counter:
        loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()}
    return grads, counter.counts  # type: ignore[return-value]


def test_selective_checkpointing_recomputes_element_wise_ops_but_no_matmul() -> None:
    plain_grads, plain = _backward_ops(None)
    full_grads, full = _backward_ops("full")
    selective_grads, selective = _backward_ops("selective")
    for name, grad in plain_grads.items():  # recompute is exact
        torch.testing.assert_close(full_grads[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(selective_grads[name], grad, rtol=0, atol=0, msg=name)
    matmuls = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")
    layers = Qwen3Config.tiny().num_hidden_layers

    def recomputed(counts: Counter[str]) -> int:
        return sum(counts[op] - plain[op] for op in matmuls)

    # full recompute runs each layer's forward matmuls again (the projections and attention) ...
    assert recomputed(full) >= 5 * layers
    # ... selective runs none of them again, but does recompute the element-wise ops (RMSNorm's rsqrt)
    assert recomputed(selective) == 0
    assert selective["rsqrt"] > plain["rsqrt"]


def test_an_unknown_checkpointing_kind_is_refused_when_the_strategy_is_built() -> None:
    from lightning_d9d import D9DStrategy

    with pytest.raises(ValueError, match="activation_checkpointing='some': choose False, True"):
        D9DStrategy(activation_checkpointing="some")
