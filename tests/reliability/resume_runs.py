"""Interrupted and uninterrupted ``Trainer(strategy="d9d")`` fits of a tiny module that records what it saw.

Usage: ``python resume_runs.py '<json list of runs>'``; each run is forked onto ``run["devices"]`` ranks
(``tests/callbacks/trainer_runs.py``'s launcher) and every rank writes ``{"batches", "draws", "params"}`` to
``run["out"]`` with ``-{rank}`` before the suffix. The training step draws from torch's global generator and
the loss depends on the draw, so a random stream that resumes differently changes the parameters too.

A run trains to ``run["max_steps"]`` from ``run.get("resume_from")``; ``run["save"]`` writes a checkpoint at
``run["save_step"]`` in one of the ways a user can: ``"callback"`` (``ModelCheckpoint(every_n_train_steps)``),
``"during"`` (``trainer.save_checkpoint`` from a callback's ``on_train_batch_end``) or ``"after"``
(``trainer.save_checkpoint`` once ``fit`` has returned, ``max_steps`` being the save step). ``run["loader"]``
is the training loader's class: ``"plain"`` (a ``DataLoader``, the default), ``"own"`` (an
``OwnPositionLoader``) or ``"stateful"`` (torchdata's ``StatefulDataLoader``); every rank also writes the class of
the loader the Trainer drew from (``"loader"``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "callbacks")]
import trainer_runs  # noqa: E402

from lightning_d9d import D9DStrategy  # noqa: E402

SAMPLES = 8  # per-rank batch 1: 8 batches an epoch on 1 rank, 4 on 2


class Recording(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.batches: list[int] = []
        self.draws: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        draw = torch.rand(())  # as dropout or masking would draw
        self.batches.append(int(batch[0, 0]))
        self.draws.append(float(draw))
        return (self.net(batch.float()) * (1 + draw)).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val", self.net(batch.float()).mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class SaveAt(Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class OwnPositionLoader(DataLoader):
    """A user's loader that keeps its own position (so the strategy leaves it as it is): the strategy puts
    the random states back at the first ``on_train_batch_start`` of a mid-epoch resume instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = self.seen = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        self.seen = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.seen += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["seen"]


def _stateful_loader() -> type[DataLoader]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


LOADERS: dict[str, Callable[[], type[DataLoader]]] = {
    "plain": lambda: DataLoader,
    "own": lambda: OwnPositionLoader,
    "stateful": _stateful_loader,
}


def _samples() -> torch.Tensor:
    return torch.stack([torch.arange(SAMPLES), torch.ones(SAMPLES, dtype=torch.int64)], dim=1)


def resume_run(run: dict[str, Any]) -> None:
    L.seed_everything(7, verbose=False)
    module = Recording()
    callbacks: list[Callback] = []
    save, step = run.get("save"), run.get("save_step")
    if save == "callback":
        callbacks.append(ModelCheckpoint(dirpath=run["ckpt"], every_n_train_steps=step, save_top_k=-1))
    elif save == "during":
        callbacks.append(SaveAt(step, run["ckpt"]))
    trainer = L.Trainer(
        strategy=D9DStrategy(),
        accelerator="cpu",
        devices=run["devices"],
        max_steps=run["max_steps"],
        logger=False,
        enable_checkpointing=save == "callback",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        limit_val_batches=2,
        val_check_interval=0.5,  # validation mid-epoch and at its end: its iterator draws a seed too
    )
    loader = LOADERS[run.get("loader", "plain")]()
    train, val = loader(_samples(), batch_size=1), DataLoader(_samples(), batch_size=1)
    trainer.fit(module, train, val, ckpt_path=run.get("resume_from"))
    if save == "after":
        trainer.save_checkpoint(run["ckpt"])
    params = {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in module.named_parameters()
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(run["out"])
    result = {"batches": module.batches, "draws": module.draws, "params": params, "step": trainer.global_step}
    result["loader"] = type(trainer.train_dataloader).__name__
    torch.save(result, out.with_name(f"{out.stem}-{rank}{out.suffix}"))


trainer_runs.KINDS["resume"] = resume_run

if __name__ == "__main__":
    for one in json.loads(sys.argv[1]):
        trainer_runs.launch(one)
