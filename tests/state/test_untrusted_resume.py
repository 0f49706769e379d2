"""Crafted checkpoints through the Trainer's own resume path, with ``weights_only`` left at its default (the
Trainer passes ``None``): a pickle that would call a function is refused, naming the file or entry, and nothing
runs. The loader's own cases are in ``test_checkpoint_integrity.py``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_checkpoint_integrity import Payload, craft_bytes_entry
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d.state import manifest
from lightning_d9d.state.errors import CheckpointFileError, CorruptIndexError
from lightning_d9d.state.training import META_NAME


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        yield


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _trainer(steps: int) -> L.Trainer:
    return L.Trainer(
        strategy="d9d",
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _loader() -> DataLoader[torch.Tensor]:
    return DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), batch_size=2)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    trainer = _trainer(2)
    trainer.fit(Regression(), _loader())
    trainer.save_checkpoint(tmp_path / "ckpt")
    Payload.mark = tmp_path / "was_run"
    return tmp_path / "ckpt"


def test_a_crafted_bytes_entry_fails_the_resume_and_runs_nothing(checkpoint: Path) -> None:
    name = craft_bytes_entry(checkpoint, Payload())
    with pytest.raises(CorruptIndexError, match="refusing to unpickle") as caught:
        _trainer(4).fit(Regression(), _loader(), ckpt_path=checkpoint)
    assert repr(name) in str(caught.value)
    assert not Payload.mark.exists()


def test_a_crafted_meta_pt_fails_load_checkpoint_with_the_default_weights_only(checkpoint: Path) -> None:
    torch.save({"loops": Payload()}, checkpoint / META_NAME)
    entries = manifest.read_manifest(checkpoint)  # the manifest agreeing: crafted, not damaged
    entries[META_NAME] = manifest.checksum(checkpoint / META_NAME)
    manifest.write_manifest(checkpoint, entries)
    trainer = _trainer(2)
    trainer.fit(Regression(), _loader())  # a strategy with a model and optimizer to load into
    with pytest.raises(CheckpointFileError, match=r"posix\.mkdir") as caught:
        trainer.strategy.load_checkpoint(checkpoint)  # weights_only left alone, as the Trainer leaves it
    assert str(checkpoint / META_NAME) in str(caught.value)
    assert not Payload.mark.exists()
    with pytest.raises(CheckpointFileError, match=r"posix\.mkdir"):  # and through fit's resume
        _trainer(4).fit(Regression(), _loader(), ckpt_path=checkpoint)
    assert not Payload.mark.exists()


def test_a_crafted_checkpoint_file_fails_load_checkpoint_with_the_default_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint file (Lightning's own format, ``save_distributed_checkpoint=False``) is untrusted too: the
    strategy asks for ``weights_only=True`` itself rather than leaving it to torch's default, which this
    environment variable turns off (so the test fails if the strategy passed ``None`` on)."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    Payload.mark = tmp_path / "was_run"
    torch.save({"state_dict": {}, "x": Payload()}, tmp_path / "step=2.ckpt")
    trainer = _trainer(2)
    trainer.fit(Regression(), _loader())
    with pytest.raises(Exception, match=r"posix\.mkdir"):
        trainer.strategy.load_checkpoint(tmp_path / "step=2.ckpt")
    assert not Payload.mark.exists()
