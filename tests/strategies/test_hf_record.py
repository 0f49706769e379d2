"""The strategy records the model's Hugging Face config in every training checkpoint it saves (when there is one
answer), so ``convert dcp-to-hf`` needs no ``--config`` (end to end: tests/examples/test_demo.py)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.state.training import recorded_hf_config
from lightning_d9d.strategies.hf_record import model_hf_config, with_hf_config


def _model(**overrides: object) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        return Qwen3ForCausalLM(Qwen3Config.tiny(**overrides))


def test_the_one_model_config_is_recorded_and_read_back() -> None:
    holder = nn.Module()
    holder.model = _model()
    checkpoint = with_hf_config({"state_dict": {}, "epoch": 0}, holder)
    assert checkpoint["hf_config"] == Qwen3Config.tiny().to_hf_dict()
    assert recorded_hf_config(checkpoint) == Qwen3Config.tiny().to_hf_dict()


def test_no_config_or_two_different_ones_record_nothing() -> None:
    assert model_hf_config(nn.Linear(2, 2)) is None
    two = nn.Module()
    two.student, two.teacher = _model(), _model(num_hidden_layers=1)
    assert model_hf_config(two) is None
    assert "hf_config" not in with_hf_config({"epoch": 0}, two)
    same = nn.Module()
    same.a, same.b = _model(), _model()  # the same config twice: one answer
    assert model_hf_config(same) == Qwen3Config.tiny().to_hf_dict()


def test_a_config_already_recorded_is_kept() -> None:
    checkpoint = with_hf_config({"hf_config": {"model_type": "mine"}}, _model())
    assert checkpoint["hf_config"] == {"model_type": "mine"}
