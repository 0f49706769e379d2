"""``StochasticAdamW`` through ``D9DStrategy`` and a Trainer fit (tiny Qwen3, ``bf16-true``, FSDP on one rank so the
parameters are DTensors, norm clipping on): the loss falls, and a resume from the strategy's checkpoint (DCP)
continues every parameter and state tensor bit for bit."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config
from lightning_d9d.optim import StochasticAdamW

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        yield


class StochasticPretraining(Qwen3Pretraining):
    def __init__(self, *args: Any, master_weights: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stochastic_master_weights = master_weights

    def configure_optimizers(self) -> StochasticAdamW:  # type: ignore[override]
        return StochasticAdamW(
            self.parameters(),
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            master_weights=self.stochastic_master_weights,
            seed=11,
        )


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def fit(
    master_weights: bool,
    steps: int,
    *,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
    resume_from: Path | None = None,
) -> tuple[StochasticPretraining, list[float]]:
    L.seed_everything(0, verbose=False)
    config = Qwen3Config.tiny()
    module = StochasticPretraining(config, master_weights=master_weights)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        strategy=D9DStrategy(),
        precision="bf16-true",
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=[losses, *callbacks],
    )
    data = SyntheticCorpus(config.vocab_size, 32, 4)  # one batch, every step: the loss must fall
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=resume_from)
    return module, losses.losses


@pytest.mark.parametrize("master_weights", [False, True], ids=["no-masters", "masters"])
def test_a_trainer_fit_trains_and_resumes_exactly(tmp_path: Path, master_weights: bool) -> None:
    uninterrupted, losses = fit(master_weights, steps=6)
    assert losses[-1] < 0.8 * losses[0]
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(master_weights, steps=3, callbacks=[checkpoints])
    resumed, resumed_losses = fit(master_weights, steps=6, resume_from=tmp_path / "step=3.ckpt")
    assert len(resumed_losses) == 3  # it resumed: steps 4-6 only
    assert resumed_losses == losses[3:]
    assert uninterrupted.model is not None and resumed.model is not None
    expected_state, resumed_state = (
        module.trainer.optimizers[0].state for module in (uninterrupted, resumed)
    )
    for (name, expected), param in zip(
        uninterrupted.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert isinstance(param, DTensor) and param.dtype == torch.bfloat16, name
        assert torch.equal(param.full_tensor(), expected.full_tensor()), name
        assert int(resumed_state[param]["step"]) == 6
        keys = ("exp_avg", "exp_avg_sq", "master") if master_weights else ("exp_avg", "exp_avg_sq")
        assert set(resumed_state[param]) == {"step", *keys}
        for key in keys:
            got, want = resumed_state[param][key], expected_state[expected][key]
            assert got.dtype == want.dtype and torch.equal(got.full_tensor(), want.full_tensor()), (
                f"{key} of {name}"
            )
