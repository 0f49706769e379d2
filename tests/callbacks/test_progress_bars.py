"""``Throughput``'s fields show on both of Lightning's progress bars, as rendered text (TQDM's postfix, Rich's
metrics column), in a ``Trainer(strategy="d9d")`` run."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from test_throughput import TinyModule, _batches

from lightning_d9d.callbacks import Throughput

FIELDS = ("perf/tokens_per_sec", "perf/step_time", "perf/tflops")


def _fit(bar: ProgressBar) -> None:
    trainer = L.Trainer(
        strategy="d9d",
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[Throughput(window=2), bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(), torch.utils.data.DataLoader(_batches(4), batch_size=None))


def test_tqdm_shows_the_throughput_fields(capsys: pytest.CaptureFixture[str]) -> None:
    _fit(TQDMProgressBar(refresh_rate=1))
    rendered = capsys.readouterr()
    text = rendered.out + rendered.err
    for field in FIELDS:
        assert f"{field}=" in text, field


def test_rich_shows_the_throughput_fields() -> None:
    screen = io.StringIO()
    _fit(
        RichProgressBar(refresh_rate=1, console_kwargs={"file": screen, "force_terminal": True, "width": 400})
    )
    text = screen.getvalue()
    for field in FIELDS:
        assert f"{field}:" in text, field
