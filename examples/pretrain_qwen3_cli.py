"""Pretrain Qwen3 / Qwen3-MoE from a YAML file with Lightning's ``LightningCLI``: the strategy's degrees, the model
and the trainer all come from the file, and any value can be overridden on the command line.

    python examples/pretrain_qwen3_cli.py fit --config examples/configs/cpu_tiny.yaml
    python examples/pretrain_qwen3_cli.py fit --config examples/configs/one_gpu.yaml --trainer.max_steps 50
    python examples/pretrain_qwen3_cli.py fit --config examples/configs/eight_gpus.yaml \
        --trainer.logger.class_path lightning.pytorch.loggers.TensorBoardLogger
    python examples/pretrain_qwen3_cli.py fit --config examples/configs/cpu_tiny.yaml --print_config  # all values

It trains the module of ``pretrain_qwen3.py`` (the ``make demo`` script) on its synthetic corpus. Needs
``jsonargparse[signatures]`` (``pip install 'lightning-d9d[cli]'``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pretrain_qwen3.py, next to this file
from pretrain_qwen3 import MODELS, Qwen3Pretraining, SyntheticCorpus

import lightning_d9d  # noqa: F401  (registers strategy="d9d"; class_path lightning_d9d.D9DStrategy works too)


class Pretraining(Qwen3Pretraining):
    """The example's module, configured by name: ``preset`` is one of ``tiny``, ``tiny-moe``, ``0.6b`` and
    ``overrides`` changes fields of its config (``num_hidden_layers``, ``tie_word_embeddings``, ...)."""

    def __init__(
        self,
        preset: str = "tiny-moe",
        overrides: dict[str, Any] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_steps: int = 100,
    ) -> None:
        if preset not in MODELS:
            raise ValueError(f"model.preset {preset!r} is not one of {', '.join(sorted(MODELS))}")
        config = MODELS[preset](**(overrides or {}))
        super().__init__(
            config, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, max_steps=max_steps
        )


class SyntheticData(L.LightningDataModule):
    """The synthetic bigram corpus of ``pretrain_qwen3.py``, sized for the model the Trainer holds.

    Args:
        batch_size: sequences per data-parallel rank and batch (the global batch is this times dp).
        seq_len: tokens per sequence.
        train_samples / val_samples: sequences in the training and the held-out set.
    """

    def __init__(
        self, batch_size: int = 8, seq_len: int = 64, train_samples: int = 2048, val_samples: int = 64
    ) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len
        self.train_samples, self.val_samples = train_samples, val_samples

    def setup(self, stage: str) -> None:
        vocab = self.trainer.lightning_module.config.vocab_size
        self.train = SyntheticCorpus(vocab, self.seq_len, self.train_samples)
        self.val = SyntheticCorpus(vocab, self.seq_len, self.val_samples, first_sample=self.train_samples)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(Pretraining, SyntheticData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
