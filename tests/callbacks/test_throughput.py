"""``Throughput`` on CPU against an injected clock: its fields reach the progress bar and the loggers, and the
numbers are the window's tokens over the window's seconds (no multi-process run: the data-parallel count is
checked in tests/strategies/test_lm_metrics_trainer.py, on the example's dp=2 and pp=2 runs)."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

import lightning_d9d.callbacks.throughput as throughput
from lightning_d9d.callbacks import Throughput, count_input_tokens, peak_flops_of

BATCH, SEQ = 4, 8
# seconds between consecutive optimizer-step ends; the first step only opens the first window
STEP_SECONDS = [0.5, 2.0, 1.0, 3.0, 0.25, 4.0, 1.5]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def num_flops_per_token(self, seq_len: int) -> int:
        return 1000 * seq_len + 7  # not the real count: any function of seq_len shows it is the one used


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 32, (count, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": one[:, :-1], "labels": one[:, 1:]} for one in ids]


def _fit(monkeypatch: pytest.MonkeyPatch, callback: Throughput, steps: int, accumulate_batches: int) -> Any:
    ticks = iter(accumulate([10.0, *STEP_SECONDS]))
    monkeypatch.setattr(throughput, "perf_counter", lambda: next(ticks))  # read once per optimizer step
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate_batches,
        callbacks=[callback],
        logger=logger,
        log_every_n_steps=1000,  # the callback logs when its window closes, not on Lightning's schedule
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(TinyModule(), DataLoader(_batches(steps * accumulate_batches), batch_size=None))
    return trainer, logger


def test_tokens_flops_and_mfu_against_an_injected_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    window, accumulation, peak = 3, 2, 5e9
    trainer, logger = _fit(monkeypatch, Throughput(window=window, peak_flops=peak), 7, accumulation)
    step_tokens = BATCH * SEQ * accumulation  # one process: dp = 1
    flops_per_token = 1000 * SEQ + 7
    windows = [STEP_SECONDS[0:3], STEP_SECONDS[3:6]]  # steps 2-4 and 5-7; step 1 opened the first window
    expected = []
    for seconds in windows:
        tokens_per_sec = window * step_tokens / sum(seconds)
        expected.append(
            {
                "perf/tokens_per_sec": tokens_per_sec,
                "perf/tokens_per_sec_per_device": tokens_per_sec,
                "perf/step_time": sum(seconds) / window,
                "perf/tflops": flops_per_token * tokens_per_sec / 1e12,
                "perf/tflops_per_device": flops_per_token * tokens_per_sec / 1e12,
                "perf/mfu": flops_per_token * tokens_per_sec / peak,
            }
        )
    perf = [(step, metrics) for step, metrics in logger.logged if any(k.startswith("perf/") for k in metrics)]
    assert [step for step, _ in perf] == [4, 7]
    for (_, actual), wanted in zip(perf, expected, strict=True):
        assert actual.keys() == wanted.keys()  # CPU: no memory field
        for name, value in wanted.items():
            assert actual[name] == pytest.approx(value, rel=1e-12), name
    bar = trainer.progress_bar_metrics
    assert set(expected[-1]) <= set(bar)
    for name, value in expected[-1].items():
        assert bar[name] == pytest.approx(value, rel=1e-6), name  # Lightning keeps them as float32


def test_mfu_only_with_a_peak_and_flops_only_with_a_model_count(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, _ = _fit(monkeypatch, Throughput(window=2), 3, 1)
    assert "perf/tflops" in trainer.progress_bar_metrics  # the model's num_flops_per_token was found
    assert "perf/mfu" not in trainer.progress_bar_metrics  # CPU: no peak unless given
    counted = Throughput(window=2, flops_per_token=lambda seq_len: 0.0, prog_bar=False)
    trainer, logger = _fit(monkeypatch, counted, 3, 1)
    assert not any(k.startswith("perf/") for k in trainer.progress_bar_metrics)
    assert counted.metrics["tflops"] == 0.0 and "perf/tokens_per_sec" in logger.logged[-1][1]


def test_token_counting_and_peaks() -> None:
    assert count_input_tokens({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)}) == (15, 5)
    assert count_input_tokens((torch.zeros(2, 7, dtype=torch.long), torch.zeros(2))) == (14, 7)
    with pytest.raises(ValueError, match="count_tokens"):
        count_input_tokens({"text": "no tensors"})
    assert peak_flops_of(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)
