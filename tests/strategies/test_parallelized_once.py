"""A module is made parallel once, by whichever d9d strategy sees it first: a later fit with a new Trainer (a new
strategy) finds it parallel and trains it as it is. The strategies keep that record beside the module, never on
it: a user's module holds no attributes of ours."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.strategies import prepare
from lightning_d9d.strategies.base import parallelize_once


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: L.LightningModule) -> None:
    trainer = L.Trainer(
        strategy=D9DStrategy(),  # FSDP on the one rank: sharding a second time would wrap the units again
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=2))


def _ours(module: nn.Module) -> list[str]:
    """The attributes of ours on ``module`` or any of its children."""
    return [f"{name}.{key}" for name, child in module.named_modules() for key in vars(child) if "d9d" in key]


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[None]:
    calls: list[None] = []
    plan = getattr(prepare, name)

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(None)
        plan(*args, **kwargs)

    monkeypatch.setattr(prepare, name, counted)
    return calls


def test_a_second_fit_trains_the_parallel_module_and_finds_no_attributes_of_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _counting(monkeypatch, "parallelize")
    module = Regression()
    _fit(module)
    weight = module.layer.weight
    trained = weight.detach().full_tensor().clone()
    _fit(module)  # a new Trainer, a new strategy
    assert len(calls) == 1
    assert module.layer.weight is weight  # the same parameter, trained on
    assert not torch.equal(module.layer.weight.detach().full_tensor(), trained)
    assert _ours(module) == []


def test_fabric_sets_a_module_up_once_and_leaves_no_attributes_of_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _counting(monkeypatch, "parallelize_root")
    model = nn.Linear(8, 8)
    for _ in range(2):  # a second Fabric, a second strategy
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=D9DFabricStrategy())
        fabric.launch()
        fabric.setup_module(model)
    assert len(calls) == 1
    assert _ours(model) == []


def test_the_record_keeps_the_runner_and_goes_with_its_module() -> None:
    module = nn.Linear(2, 2)
    runner: Any = object()  # stands for the pipeline runner the first parallelization built
    assert parallelize_once(module, lambda: runner) is runner
    assert parallelize_once(module, lambda: pytest.fail("parallelized twice")) is runner
    gone = weakref.ref(module)
    del module
    gc.collect()
    assert gone() is None


class _PipelinedLM(L.LightningModule):
    """A pipelined Qwen3 whose loss is a bound method of the module: the runner must not keep it alive."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM

        self.model = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=False, num_hidden_layers=2))

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from lightning_d9d import model_loss

        return model_loss(self, self.model, (batch[:, :-1],), batch[:, 1:], self.loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _pipelined_module_is_freed_after_fit() -> bool:
    import os

    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], TORCHELASTIC_RUN_ID="freed")
    trainer = L.Trainer(
        strategy=D9DStrategy(pp=2, microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _PipelinedLM()
    data = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=4))
    gone = weakref.ref(module)
    del module, trainer
    gc.collect()
    return gone() is None


def test_a_pipelined_module_whose_loss_is_its_own_method_is_freed_after_fit() -> None:
    from distributed import run_distributed

    assert run_distributed(_pipelined_module_is_freed_after_fit, 2, timeout=180) == [True, True]
