"""Activation checkpointing must recompute exactly what forward computed, random ops included (defect 7)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

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
