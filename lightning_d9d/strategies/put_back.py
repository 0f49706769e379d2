"""Checkpoints that a crash left aside, put back before Lightning resolves ``ckpt_path="last"``.

Replacing ``last.ckpt`` renames the old one aside, then the new one in (``state/atomic.py``): a crash between the
two renames leaves no ``last.ckpt``, only ``.last.ckpt.old-XXXXXXXX``. Lightning resolves ``ckpt_path="last"``
(``Trainer._fit_impl`` → ``_checkpoint_connector._select_ckpt_path`` → ``ModelCheckpoint._find_last_checkpoints``)
inside the function that the strategy's launcher runs, before any hook of the strategy: the launcher's ``launch``
is the earliest point the strategy controls. So the strategy always has a launcher, Lightning's own (it starts the
other processes) or :class:`DirectLauncher` where Lightning has none (processes started by torchrun or SLURM, or
one process), and its ``launch`` first puts back what it finds in the ``ModelCheckpoint`` folders. Every process
does (the children of Lightning's launcher run their script again): the put-back is race-safe
(:func:`~lightning_d9d.state.atomic.put_back`).

What this relies on of Lightning (``launch`` called with ``trainer=``, the launcher's ``launch`` signature, the
folder ``ModelCheckpoint`` looks for ``last`` in) is listed in ``lightning_d9d/compat.py`` and pinned by
``tests/test_compat.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_d9d.compat import checkpoint_dir
from lightning_d9d.state.atomic import put_back_interrupted

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class DirectLauncher:
    """The launcher where Lightning starts no processes: it runs the function in this process (what Lightning does
    itself when a strategy has no launcher)."""

    is_interactive_compatible = True

    def launch(
        self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
    ) -> Any:
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """No processes of its own to kill."""


def checkpoint_folder(callback: ModelCheckpoint, trainer: pl.Trainer) -> Path | None:
    """The folder ``callback`` saves into and looks for ``last`` in, as ``ModelCheckpoint`` resolves it
    (:func:`~lightning_d9d.compat.checkpoint_dir`); None for a remote one (``s3://...``): atomic saves are local
    file systems' only."""
    folder = checkpoint_dir(callback, trainer)
    if "://" in folder:
        return None
    return Path(folder)


def put_back_checkpoints(trainer: pl.Trainer) -> list[Path]:
    """Put back every checkpoint of the trainer's ``ModelCheckpoint`` folders whose replacement a crash interrupted
    between its two renames; the paths this process put back (each is logged)."""
    restored: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        folder = checkpoint_folder(callback, trainer)
        if folder is None:
            continue
        for path in put_back_interrupted(folder):
            log.warning(
                "put back %s: a save replacing it was interrupted between its two renames, with the previous "
                "checkpoint left aside (ckpt_path='last' resumes from it)",
                path,
            )
            restored.append(path)
    return restored


def put_back_before_launch(launcher: Any) -> Any:
    """``launcher`` (or a :class:`DirectLauncher` where it is None) whose ``launch`` first runs
    :func:`put_back_checkpoints` for the trainer it is given. The launcher object stays the same (Lightning tests its
    class, e.g. to kill the processes on Ctrl+C)."""
    if launcher is None:
        launcher = DirectLauncher()
    launch = launcher.launch

    def launch_after_put_back(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        trainer = kwargs.get("trainer")
        if trainer is not None:
            put_back_checkpoints(trainer)
        return launch(function, *args, **kwargs)

    launcher.launch = launch_after_put_back
    return launcher
