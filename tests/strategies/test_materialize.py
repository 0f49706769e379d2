"""Meta tensors get their memory without wiping torchmetrics metrics: ``module.to_empty`` on the whole
LightningModule used to replace every metric's states and defaults by uninitialised memory (the demo's
validation perplexity came back as ``inf`` in some runs)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import SumMetric

from lightning_d9d.modules.metrics import CausalLMPerplexity
from lightning_d9d.strategies.materialize import to_empty_except_metrics


def test_metric_states_and_defaults_are_left_alone() -> None:
    holder = nn.Module()
    with torch.device("meta"):
        holder.layer = nn.Linear(3, 3)
    holder.total = SumMetric()
    holder.total.update(torch.tensor(5.0))
    state, default = holder.total.sum_value, holder.total._defaults["sum_value"]
    to_empty_except_metrics(holder, torch.device("cpu"))
    assert not holder.layer.weight.is_meta
    assert holder.total.sum_value is state and holder.total._defaults["sum_value"] is default
    assert float(holder.total.compute()) == 5.0
    holder.total.reset()
    assert float(holder.total.compute()) == 0.0


class MetaModelWithPerplexity(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.perplexity = CausalLMPerplexity()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            with torch.device("meta"):
                self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        assert self.net is not None
        loss = self.net(batch).pow(2).mean()
        self.log("val/loss", loss)
        self.perplexity.update(loss * 10, 10)
        self.log("val/ppl", self.perplexity)


def test_a_metric_of_a_meta_built_module_computes_from_what_it_was_fed() -> None:
    trainer = L.Trainer(
        strategy="d9d",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = MetaModelWithPerplexity()
    metrics = trainer.validate(module, DataLoader(torch.randn(1, 4), batch_size=1), verbose=False)[0]
    assert module.perplexity._defaults["loss_sum"].item() == 0.0  # reset() restores zeros, not garbage
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-5)


def test_a_parameter_shared_by_two_modules_stays_one() -> None:
    # nn.Module.to_empty gives each module its own copy of a tied weight (an embedding and its LM head)
    with torch.device("meta"):
        holder = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    holder[1].weight = holder[0].weight
    to_empty_except_metrics(holder, torch.device("cpu"))
    assert holder[1].weight is holder[0].weight and not holder[0].weight.is_meta
    assert len(list(holder.parameters())) == 1
