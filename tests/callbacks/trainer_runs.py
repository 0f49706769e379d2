"""Short ``Trainer(strategy="d9d")`` fits, one after another, each on N ranks forked from this process.

Usage: ``python trainer_runs.py '<json list of runs>'``. A run is a dict with ``"kind"`` (``"hf"`` or
``"train"``), ``"devices"`` and its options (see ``hf_run`` and ``train_run``); its rank 0 saves what the tests
compare to ``run["out"]``. The script exits non-zero as soon as a rank of a run fails.

Each rank gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...,
``TORCHELASTIC_RUN_ID``), so Lightning treats it as launched from outside and does not launch processes itself.
Forking after the imports saves every rank the ~10 s of ``import lightning`` of a 2-core machine, which is most
of the cost of a short run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

# Imported before forking, so that no rank pays for them again.
import lightning as L
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.tensor
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
from distributed import (  # noqa: E402
    LIBC_CRASHES,
    free_port,
    freeze_inherited_heap,
    set_torchrun_environment,
)
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus  # noqa: E402

from lightning_d9d import D9DStrategy  # noqa: E402
from lightning_d9d.callbacks import ExportHF, LoadHFWeights  # noqa: E402
from lightning_d9d.models import Qwen3Config  # noqa: E402
from lightning_d9d.state.hf import read_hf_config  # noqa: E402


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, by its state-dict name (a collective under FSDP: all ranks call it)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
    }


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


class SnapshotBeforeFirstForward(Callback):
    """The parameters as the first forward pass (sanity check or training) will see them. Placed after
    ``LoadHFWeights``, it shows whether the weights were loaded after the strategy's initialisation (and not
    overwritten by it) and after a checkpoint to resume from was restored."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] | None = None

    def on_sanity_check_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._snapshot(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._snapshot(pl_module)

    def _snapshot(self, pl_module) -> None:  # type: ignore[no-untyped-def]
        if self.params is None:
            self.params = full_parameters(pl_module.model)


def _trainer(run: dict[str, Any], callbacks: list[Callback], checkpoint_every: int | None) -> L.Trainer:
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=run["ckpt_dir"],
                every_n_train_steps=checkpoint_every,
                save_top_k=-1,
                filename="{step}",
            )
        )
    return L.Trainer(
        strategy=D9DStrategy(**run.get("dims", {})),
        accelerator="cpu",
        devices=run["devices"],
        precision="32-true",
        max_steps=run["max_steps"],
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        limit_val_batches=1,
        num_sanity_val_steps=1,
    )


def hf_run(run: dict[str, Any]) -> None:
    """Train from the HF checkpoint ``run["hf_dir"]`` with ``LoadHFWeights`` (or resume from
    ``run["resume_from"]``), export with ``ExportHF`` every ``run["export_every"]`` steps and at the end, and save
    a training checkpoint every ``run["save_every"]`` steps."""
    L.seed_everything(run["seed"], verbose=False)
    config = Qwen3Config.from_hf_dict(read_hf_config(run["hf_dir"]))
    snapshot, recorder = SnapshotBeforeFirstForward(), RecordLosses()
    export = ExportHF(run["export_dir"], every_n_train_steps=run.get("export_every"), max_shard_size="40KB")
    trainer = _trainer(run, [LoadHFWeights(run["hf_dir"]), snapshot, recorder, export], run["save_every"])
    module = Qwen3Pretraining(config, lr=run["lr"], warmup_steps=1, max_steps=run["max_steps"])
    data = SyntheticCorpus(config.vocab_size, run["seq_len"], run["global_batch"] * run["max_steps"])
    per_rank = run["global_batch"] // run.get("dp", trainer.world_size)  # tp / cp peers share a batch
    val = SyntheticCorpus(config.vocab_size, run["seq_len"], run["global_batch"], first_sample=10_000)
    # With validation data the sanity check runs first: the weights must be loaded before it.
    trainer.fit(
        module, DataLoader(data, batch_size=per_rank), DataLoader(val, batch_size=per_rank),
        ckpt_path=run.get("resume_from"),
    )  # fmt: skip
    result = {
        "start": snapshot.params,
        "final": full_parameters(module.model),
        "losses": recorder.losses,
        "exports": [str(path) for path in export.exported],
    }
    if trainer.is_global_zero:
        torch.save(result, run["out"])


def train_run(run: dict[str, Any]) -> None:
    """The parity tests' training (``tests/strategies``): same seed, data, optimizer and schedule, so that
    ``reference_run`` of the same config is the single-process loop it must match. With ``run["export_dir"]``,
    ``ExportHF`` writes the final weights there."""
    L.seed_everything(run["seed"], verbose=False)
    config = Qwen3Config.tiny(**run.get("model", {}))
    recorder = RecordLosses()
    callbacks: list[Callback] = [recorder]
    if run.get("export_dir"):
        callbacks.append(ExportHF(run["export_dir"], filename="final"))
    trainer = _trainer(run, callbacks, run.get("save_every"))
    module = Qwen3Pretraining(config, lr=run["lr"], warmup_steps=2, max_steps=run["schedule_steps"])
    data = SyntheticCorpus(config.vocab_size, run["seq_len"], run["global_batch"] * run["steps_per_epoch"])
    loader = DataLoader(data, batch_size=run["global_batch"] // run["dp"])
    trainer.fit(module, loader, ckpt_path=run.get("resume_from"))
    result = {"losses": recorder.losses, "params": full_parameters(module)}
    if trainer.is_global_zero:
        torch.save(result, run["out"])


KINDS = {"hf": hf_run, "train": train_run}


def _rank(run: dict[str, Any], rank: int, port: int) -> None:
    code = 0
    freeze_inherited_heap()
    try:
        set_torchrun_environment(rank, run["devices"], port, f"trainer-runs-{port}")
        torch.set_num_threads(1)
        KINDS[run["kind"]](run)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # gloo may abort at interpreter exit after all work succeeded: leave without running it.
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(run: dict[str, Any], timeout: float = 300) -> None:
    """``run`` on its ranks; a rank that died by a signal of ``LIBC_CRASHES`` has the run forked anew once."""
    failed, crash = _launch_once(run, timeout)
    if crash in LIBC_CRASHES:
        print(f"a rank died by {signal.Signals(crash).name}; running it once more", file=sys.stderr)
        failed, crash = _launch_once(run, timeout)
    if failed is not None:
        raise SystemExit(f"run {run.get('name', run['kind'])}: {failed}")


def _launch_once(run: dict[str, Any], timeout: float) -> tuple[str | None, int | None]:
    """What failed (``None``: nothing) and the signal a rank died by before we killed any."""
    context = mp.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(run, rank, port)) for rank in range(run["devices"])]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    pending = list(ranks)
    failed = None
    while pending and time.monotonic() < deadline:
        wait([process.sentinel for process in pending], timeout=1.0)
        for process in [p for p in pending if p.exitcode is not None]:
            pending.remove(process)
            if process.exitcode != 0 and failed is None:
                failed = f"rank {ranks.index(process)} exited with {process.exitcode}"
                # the peers get a moment: one that crashed first is then still seen crashing
                deadline = min(deadline, time.monotonic() + 2.0)
    if pending and failed is None:
        failed = f"timed out after {timeout:.0f} s"
    crashes = [-p.exitcode for p in ranks if p.exitcode is not None and p.exitcode < 0]
    for process in pending:  # they may wait forever in a collective with the failed rank
        process.kill()
        process.join()
    return failed, (crashes[0] if crashes else None)


if __name__ == "__main__":
    for one in json.loads(sys.argv[1]):
        launch(one)
