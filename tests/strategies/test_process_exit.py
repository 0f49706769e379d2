"""A script that trains and returns leaves no process group to the interpreter's teardown (where gloo can abort
the process after every step succeeded): both strategies register a handler that destroys it at exit."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_d9d.fabric.strategy import D9DFabricStrategy
from lightning_d9d.strategies import process_exit
from lightning_d9d.strategies.d9d import D9DStrategy


@pytest.fixture
def exit_handlers(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """What the package hands to ``atexit``, kept here instead (this process's real exit is pytest's)."""
    handlers: list[Callable[[], None]] = []
    monkeypatch.setattr(process_exit, "_registered", False)
    monkeypatch.setattr(process_exit.atexit, "register", handlers.append)
    return handlers


def _fabric_launch() -> None:
    L.Fabric(accelerator="cpu", devices=1, strategy=D9DFabricStrategy()).launch()


def _trainer_fit() -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=D9DStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())


@pytest.mark.parametrize("run", [_fabric_launch, _trainer_fit], ids=["fabric", "trainer"])
def test_the_process_group_is_destroyed_at_exit(
    run: Callable[[], None], exit_handlers: list[Callable[[], None]]
) -> None:
    run()
    assert dist.is_initialized()  # Lightning leaves the group up when a run returns
    assert len(exit_handlers) == 1
    exit_handlers[0]()
    assert not dist.is_initialized()


def test_the_handler_is_registered_once(exit_handlers: list[Callable[[], None]]) -> None:
    process_exit.destroy_process_group_at_exit()
    process_exit.destroy_process_group_at_exit()
    assert len(exit_handlers) == 1
    exit_handlers[0]()  # no group: nothing to do, no error
