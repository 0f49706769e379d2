"""``fit(ckpt_path="last")`` after a crash between the two renames of a ``last`` replacement (the old
``last.ckpt`` renamed aside to ``.last.ckpt.old-XXXXXXXX``, the new one not yet in): the strategy's launcher puts
the old one back before Lightning resolves ``"last"``, so the run resumes from it instead of starting over.

One process, in this process, on CPU, started as by Lightning (its launcher, wrapped) or as by torchrun (no
launcher of Lightning's: the strategy's direct one); then 2 ranks under torchrun racing for the rename. The
crash is simulated by the rename it left undone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from distributed import free_port, freeze_inherited_heap, set_torchrun_environment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d.state import atomic
from lightning_d9d.state.training import read_meta
from lightning_d9d.strategies.put_back import DirectLauncher


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        warnings.filterwarnings("ignore", message=".*exists and is not empty")
        yield


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.first_step: int | None = None  # the global step the first training_step of this fit ran at
        self.first_weights: dict[str, torch.Tensor] = {}  # and the weights it ran with

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.first_step is None:
            self.first_step = self.trainer.global_step
            self.first_weights = {name: value.detach().clone() for name, value in self.state_dict().items()}
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader[torch.Tensor]:
    return DataLoader(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), batch_size=2)


# How the ModelCheckpoint folder is given: explicitly; derived from default_root_dir (no logger); derived from
# a logger with a fixed version. Each: (Trainer kwargs, ModelCheckpoint dirpath, the folder) for a root.
FOLDERS = {
    "dirpath": lambda root: ({"logger": False}, root / "ckpts", root / "ckpts"),
    "default_root_dir": lambda root: ({"logger": False}, None, root / "checkpoints"),
    "logger_version": lambda root: (
        {"logger": CSVLogger(root, name="run", version=0)},
        None,
        root / "run" / "version_0" / "checkpoints",
    ),
}


def _trainer(root: Path, how: str, steps: int, devices: int = 1) -> tuple[L.Trainer, Path]:
    kwargs, dirpath, folder = FOLDERS[how](root)
    checkpoints = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=2)
    trainer = L.Trainer(
        strategy="d9d",
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        default_root_dir=root,
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    return trainer, folder


@pytest.mark.parametrize(
    ("how", "started_by"),
    [*((how, "lightning") for how in sorted(FOLDERS)), ("dirpath", "torchrun")],
)
def test_fit_last_resumes_from_the_last_that_a_crash_left_aside(
    tmp_path: Path, how: str, started_by: str
) -> None:
    _in_a_fork(_fit_last_after_the_crash, tmp_path, how, started_by)


def _in_a_fork(fn: Any, *args: Any) -> None:
    """``fn(*args)`` in a process forked from this one, its failure raised here. A resume inside the test process
    leaves it unable to fork working gloo ranks later in the session (the ranks of test_save_faults.py died in
    libc's pthread_join): the fits run in a child, so the test process stays as it was."""
    context = mp.get_context("fork")
    failures = context.SimpleQueue()

    def child() -> None:
        code = 0
        freeze_inherited_heap()
        try:
            fn(*args)
        except BaseException:
            failures.put(traceback.format_exc())
            code = 1
        finally:
            os._exit(code)

    process = context.Process(target=child)
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
        raise AssertionError(f"{fn.__name__} timed out")
    if process.exitcode != 0:
        raise AssertionError(failures.get() if not failures.empty() else f"exit code {process.exitcode}")


def _fit_last_after_the_crash(tmp_path: Path, how: str, started_by: str) -> None:
    if started_by == "torchrun":  # the conftest restores the environment afterwards
        set_torchrun_environment(0, 1, free_port(), "interrupted-last")
    launcher = {"lightning": _SubprocessScriptLauncher, "torchrun": DirectLauncher}[started_by]
    environment = dict(os.environ)
    trainer, folder = _trainer(tmp_path, how, steps=4)
    assert type(trainer.strategy.launcher) is launcher
    trainer.fit(Regression(), _loader())
    # as a fresh process would start (Lightning's launcher left LOCAL_RANK & co. here: a second Trainer in this
    # process would take itself for torchrun's)
    os.environ.clear()
    os.environ.update(environment)
    last = folder / "last.ckpt"
    assert int(read_meta(last, weights_only=True)["global_step"]) == 4
    saved = {name: value.detach().clone() for name, value in trainer.lightning_module.state_dict().items()}

    # The crash: the replacement of last.ckpt (at step 6) renamed the old one aside and died before the new one.
    aside = folder / f"{atomic.aside_prefix(last)}{secrets.token_hex(4)}"
    last.rename(aside)
    assert atomic.interrupted_replacement(last) == aside

    trainer, _ = _trainer(tmp_path, how, steps=6)
    assert type(trainer.strategy.launcher) is launcher
    resumed = Regression()
    trainer.fit(resumed, _loader(), ckpt_path="last")
    assert resumed.first_step == 4, (
        f"the resumed fit started at step {resumed.first_step}, not at the saved 4"
    )
    assert resumed.first_weights.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(resumed.first_weights[name], value), name
    assert trainer.global_step == 6
    assert Path(trainer.ckpt_path or "") == last
    assert not list(folder.glob(f"{atomic.aside_prefix(last)}*"))
    assert int(read_meta(last, weights_only=True)["global_step"]) == 6  # the next save replaced it


def test_put_back_tolerates_another_process_winning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank puts back at once: one rename wins, the others find the copy gone and go on."""
    final = tmp_path / "last.ckpt"
    aside = tmp_path / f"{atomic.aside_prefix(final)}{secrets.token_hex(4)}"
    aside.mkdir()
    (aside / "meta.pt").write_bytes(b"old")
    seen = atomic.interrupted_replacement(final)
    assert seen == aside
    assert atomic.put_back_interrupted(tmp_path) == [final]  # "another rank" won
    assert (final / "meta.pt").read_bytes() == b"old"
    # this rank looked before that rename and renames after it
    monkeypatch.setattr(atomic, "interrupted_replacement", lambda path: seen)
    assert atomic.put_back(final) is False
    assert (final / "meta.pt").read_bytes() == b"old"
    monkeypatch.undo()
    assert atomic.put_back_interrupted(tmp_path) == []  # nothing left to put back


def test_lightnings_launcher_puts_back_before_it_starts_the_other_processes(tmp_path: Path) -> None:
    """With 2 devices Lightning's launcher starts the other process: the put-back comes first, so the children
    (which run the script again) find ``last.ckpt`` in place and no two processes race for it."""
    _in_a_fork(_launch_stopped_where_children_start, tmp_path)


def _launch_stopped_where_children_start(tmp_path: Path) -> None:
    monkeypatch = pytest.MonkeyPatch()
    seen: list[bool] = []

    def started(self: object) -> None:
        seen.append((tmp_path / "ckpts" / "last.ckpt" / "meta.pt").is_file())
        raise RuntimeError("stopped where the other process would start")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    aside = tmp_path / "ckpts" / f".last.ckpt.old-{secrets.token_hex(4)}"
    aside.mkdir(parents=True)
    (aside / "meta.pt").write_bytes(b"old")
    trainer, _ = _trainer(tmp_path, "dirpath", steps=4, devices=2)
    assert type(trainer.strategy.launcher) is _SubprocessScriptLauncher
    with pytest.raises(RuntimeError, match="stopped where"):
        trainer.fit(Regression(), _loader(), ckpt_path="last")
    assert seen == [True]


def crash_then_resume(root: str) -> tuple[int | None, int, str | None]:
    """One rank of ``interrupted_last_ranks.py`` (torchrun): a fit saving ``last``, the crash (rank 0 renames
    it aside), then ``fit(ckpt_path="last")``; where that fit started. Its first look for a copy aside waits
    for the other rank's, so both ranks rename the same copy: the race."""
    trainer, folder = _trainer(Path(root), "dirpath", steps=4, devices=2)
    trainer.fit(Regression(), _loader())
    last = folder / "last.ckpt"
    dist.barrier()
    if dist.get_rank() == 0:
        last.rename(folder / f"{atomic.aside_prefix(last)}{secrets.token_hex(4)}")
    dist.barrier()
    look = atomic.interrupted_replacement

    def look_then_wait(final: Path) -> Path | None:
        atomic.interrupted_replacement = look  # once: later saves look on rank 0 alone
        found = look(final)
        dist.barrier()
        return found

    atomic.interrupted_replacement = look_then_wait
    trainer, _ = _trainer(Path(root), "dirpath", steps=6, devices=2)
    assert type(trainer.strategy.launcher) is DirectLauncher
    resumed = Regression()
    trainer.fit(resumed, _loader(), ckpt_path="last")
    return resumed.first_step, trainer.global_step, trainer.ckpt_path


def test_every_rank_puts_back_and_resumes_alike(tmp_path: Path) -> None:
    """Two ranks started by torchrun both put back, at once: one rename wins, neither fails, both resume.
    (A fresh interpreter: ranks forked from this one, after its in-process Trainer runs, can crash in libc.)"""
    script = Path(__file__).with_name("interrupted_last_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [*command, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    last = tmp_path / "ckpts" / "last.ckpt"
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks == [[4, 6, str(last)]] * 2, ranks
    assert not list(last.parent.glob(f"{atomic.aside_prefix(last)}*"))
