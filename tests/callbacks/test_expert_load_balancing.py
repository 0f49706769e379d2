"""``ExpertLoadBalancing``'s load statistics and argument check. Its wiring in training (the bias update after
each optimizer step, under accumulation, ep and pp, across data ranks) is checked against a single-process loop
in tests/strategies/test_expert_parallel_parity.py; that the update balances the load, in
tests/modules/moe/test_moe_balancing_training.py."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.callbacks.moe import (
    ExpertLoadBalancing,
    layer_load_statistics,
    load_statistics,
    routers_by_layer,
)
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM


def test_load_statistics_by_hand() -> None:
    stats = load_statistics(torch.tensor([0, 2, 4, 2]))
    assert stats["min"] == 0 and stats["max"] == 4
    assert stats["cv"] == pytest.approx((2**0.5) / 2)  # population std sqrt(2) over mean 2
    assert load_statistics(torch.zeros(4, dtype=torch.int64))["cv"] == 0.0  # no token yet: not a NaN


def test_every_layers_statistics_come_back_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = torch.tensor([[0, 2, 4, 2], [0, 0, 0, 0], [5, 1, 1, 1]])
    expected = [load_statistics(load) for load in loads]
    transfers: list[str] = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: transfers.append("item"))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append("tolist") or tolist(self))
    got = layer_load_statistics(loads)
    assert [list(stats) for stats in got] == [["min", "max", "cv"]] * 3
    assert [list(stats.values()) for stats in got] == [pytest.approx(list(row.values())) for row in expected]
    assert got[0]["cv"] == pytest.approx((2**0.5) / 2) and got[1]["cv"] == 0.0
    assert transfers == ["tolist"]


def test_routers_are_named_by_their_decoder_layer() -> None:
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())  # layers 0 and 2 sparse, 1 dense
    assert list(routers_by_layer(model)) == ["layer0", "layer2"]


def test_negative_rate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bias_update_rate \(-0.1\) must be >= 0"):
        ExpertLoadBalancing(-0.1)
