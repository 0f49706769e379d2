"""GarbageCollection: the collector is off during fit, runs every N optimizer steps, and comes back afterwards."""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_d9d.callbacks import GarbageCollection


class Recorder(L.LightningModule):
    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.enabled_in_steps: list[bool] = []
        self.fail_at_step = fail_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at_step:
            raise RuntimeError("boom")
        self.enabled_in_steps.append(gc.isenabled())
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: Recorder, callback: GarbageCollection, **trainer_kwargs: Any) -> None:
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, data)


def test_collects_every_n_optimizer_steps_and_restores_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(0))
    assert gc.isenabled()
    module = Recorder()
    # 2 batches per optimizer step: one collection per step, not one per batch
    fit(module, GarbageCollection(every_n_steps=3, generation=1), max_steps=7, accumulate_grad_batches=2)
    assert module.enabled_in_steps == [False] * 14
    assert collected == [2, 1, 1]  # the whole heap before training, then after steps 3 and 6
    assert gc.isenabled()


def test_the_collector_comes_back_when_fit_fails() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        fit(Recorder(fail_at_step=2), GarbageCollection(every_n_steps=1), max_steps=5)
    assert gc.isenabled()


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"every_n_steps": 0}, "every_n_steps=0"), ({"generation": 3}, "generation=3")]
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GarbageCollection(**kwargs)
