"""The strategy records the model's Hugging Face config in every training checkpoint it saves (when there is one
answer), so ``convert dcp-to-hf`` needs no ``--config`` (end to end: tests/examples/test_demo.py)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from tiny_hf import tiny_config

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.state.hf import declared_class, module_hf_config
from lightning_d9d.state.hf.io import module_hf_format
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


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone: enough for torch's wrappers to wrap."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_class_recorded_is_the_user_s_not_the_wrapper_torch_made(one_rank: None) -> None:
    """``fully_shard`` and ``replicate`` swap a module's class for one made at runtime (``FSDP<Name>``,
    ``DDP<Name>``); the config recorded and exported names the class the user built, as ``save_pretrained``
    would, including a subclass of a transformers class defined here."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard

    class TinyLlama(transformers.LlamaForCausalLM):
        pass

    for wrap in (fully_shard, replicate):
        for cls in (transformers.LlamaForCausalLM, TinyLlama):
            model = cls(tiny_config("llama", layers=1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # replicate is deprecated
                wrap(model)
            assert type(model).__name__ != cls.__name__  # torch swapped the class
            assert declared_class(model) is cls
            holder = nn.Module()
            holder.model = model
            assert with_hf_config({}, holder)["hf_config"]["architectures"] == [cls.__name__]
            assert module_hf_format(model, module_hf_config(model)).architectures == (cls.__name__,)
