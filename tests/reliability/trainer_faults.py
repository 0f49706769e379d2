"""``Trainer(strategy="d9d")`` runs with faults: a rank killed mid-step, a resume from a folder of checkpoints,
non-finite gradients under ``NonFiniteGuard``.

Usage: ``python trainer_faults.py '<json list of runs>'``; runs go through ``tests/callbacks/trainer_runs.py``
(ranks forked after the imports), as its ``"train"`` runs do, so that ``reference_run`` of the same config is
the single-process loop they must match. A run with ``"may_fail": true`` may end with a dead rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "callbacks")]
import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import trainer_runs  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_d9d.models import Qwen3Config  # noqa: E402
from lightning_d9d.strategies.guards import NonFiniteError, NonFiniteGuard  # noqa: E402


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class KillMidStep(Callback):
    """SIGKILL rank ``rank`` after the backward of step ``step`` (1-based), before its optimizer step."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step + 1 == self.step and rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class PoisonGradient(Callback):
    """Rank ``rank`` makes one gradient NaN at step ``step`` (1-based): what an overflow in backward does."""

    def __init__(self, rank: int, step: int, parameter: str) -> None:
        self.rank, self.step, self.parameter = rank, step, parameter

    def on_after_backward(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step + 1 == self.step and rank() == self.rank:
            grad = dict(pl_module.named_parameters())[self.parameter].grad
            grad.to_local().view(-1)[0] = float("nan")  # type: ignore[union-attr]


class UpdatedSteps(Callback):
    """Which steps changed the parameters (compared before and after each optimizer step)."""

    def __init__(self) -> None:
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.before = trainer_runs.full_parameters(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        after = trainer_runs.full_parameters(pl_module)
        self.changed.append(any(not torch.equal(after[n], self.before[n]) for n in after))


def faults_run(run: dict[str, Any]) -> None:
    L.seed_everything(run["seed"], verbose=False)
    config = Qwen3Config.tiny(**run.get("model", {}))
    recorder, updates = trainer_runs.RecordLosses(), UpdatedSteps()
    callbacks: list[Callback] = [recorder, updates]
    if run.get("kill"):
        callbacks.append(KillMidStep(**run["kill"]))
    guard = None
    if run.get("guard"):
        guard = NonFiniteGuard(run["guard"])
        callbacks += [PoisonGradient(**run["poison"]), guard]
    trainer = trainer_runs._trainer(run, callbacks, run.get("save_every"))
    module = Qwen3Pretraining(config, lr=run["lr"], warmup_steps=2, max_steps=run["schedule_steps"])
    data = SyntheticCorpus(config.vocab_size, run["seq_len"], run["global_batch"] * run["steps_per_epoch"])
    loader = DataLoader(data, batch_size=run["global_batch"] // run["dp"])
    result: dict[str, Any] = {}
    try:
        trainer.fit(module, loader, ckpt_path=run.get("resume_from"))
    except NonFiniteError as error:  # every rank raises it (the guard agrees across ranks)
        result["error"] = str(error)
    result.update(
        losses=recorder.losses, changed=updates.changed, params=trainer_runs.full_parameters(module)
    )
    result["skipped"] = guard.skipped if guard is not None else []
    if trainer.is_global_zero:
        torch.save(result, run["out"])


trainer_runs.KINDS["faults"] = faults_run

if __name__ == "__main__":
    for one in json.loads(sys.argv[1]):
        try:
            trainer_runs.launch(one)
        except SystemExit as failure:
            if not one.get("may_fail"):
                raise
            print(f"expected failure: {failure}", file=sys.stderr)
