"""A transformers Qwen3 trained by ``Trainer(strategy=D9DStrategy(...))``, checkpointed every few steps, and resumed
from a mid-epoch checkpoint on another layout; ranks forked from this process with torchrun's environment (so
Lightning launches nothing itself), one run after the other.

Usage: ``python hf_resume_run.py '<json list of runs>'``, each run with ``devices``, ``dims`` (the strategy's
degrees), ``out``, and optionally ``ckpt_dir`` (a ``ModelCheckpoint`` every ``SAVE_EVERY`` steps), ``resume_from``
(a checkpoint) and ``fused`` ($LIGHTNING_D9D_FUSED_LOSS=1: the fused LM head + loss on CPU). Rank 0 saves the
losses, the pre-clip gradient norms, the final parameters and how often the fused loss ran to ``out``.

Every rank reads the whole batch (``use_distributed_sampler=False``, dp = 1 on every layout run here): tp peers
hold the same batch, and one process holds it all.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
import hf_trainer_run  # noqa: E402
from test_hf_tensor_parallel import ROWS, batch, tiny_model  # noqa: E402

from lightning_d9d import D9DStrategy, model_loss  # noqa: E402
from lightning_d9d.models.hf import loss as hf_loss  # noqa: E402
from lightning_d9d.modules.loss import causal_lm_loss  # noqa: E402

# 8 steps of 4-batch epochs, a checkpoint every 2 steps: step 6 is in the middle of the second epoch.
STEPS, PER_EPOCH, SAVE_EVERY = 8, 4, 2
FUSED_CALLS = [0]
_linear_cross_entropy = hf_loss.linear_cross_entropy


def _counted(*args: Any, **kwargs: Any) -> torch.Tensor:
    FUSED_CALLS[0] += 1
    return _linear_cross_entropy(*args, **kwargs)


hf_loss.linear_cross_entropy = _counted


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class HFCausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model("qwen3", False)
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # causal_lm_loss on the transformers output itself (its .logits), or fused from the hidden states
        loss = model_loss(self, self.model, (data["input_ids"],), data["labels"], causal_lm_loss)
        self.losses.append(float(loss.detach()))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.norms.append(
            math.sqrt(sum(float(full(p.grad).double().square().sum()) for p in self.parameters()))
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # as test_hf_tensor_parallel.train
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)


def samples() -> list[dict[str, torch.Tensor]]:
    rows = []
    for step in range(PER_EPOCH):
        ids, labels = batch(step)
        rows += [{"input_ids": ids[r], "labels": labels[r]} for r in range(ROWS)]
    return rows


def fit(run: dict[str, Any]) -> None:
    if run.get("fused"):
        os.environ["LIGHTNING_D9D_FUSED_LOSS"] = "1"
    FUSED_CALLS[0] = 0
    module = HFCausalLM()
    callbacks = []
    if run.get("ckpt_dir"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=run["ckpt_dir"], every_n_train_steps=SAVE_EVERY, save_top_k=-1, filename="{step}"
            )
        )
    trainer = L.Trainer(
        strategy=D9DStrategy(**run["dims"]),
        accelerator="cpu",
        devices=run["devices"],
        precision="32-true",
        max_steps=STEPS,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    if run["devices"] != run["dims"].get("tp", 1):
        raise ValueError("the script feeds every rank the whole batch: tp only (dp = 1)")
    loader = DataLoader(samples(), batch_size=ROWS, shuffle=False)
    trainer.fit(module, loader, ckpt_path=run.get("resume_from"))
    params = {name: full(p).detach().clone() for name, p in module.model.named_parameters()}
    if trainer.is_global_zero:
        result = {"losses": module.losses, "norms": module.norms, "params": params, "fused": FUSED_CALLS[0]}
        torch.save(result, run["out"])
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    hf_trainer_run.fit = fit  # its launcher's ranks call the module's fit: this one
    for one in json.loads(sys.argv[1]):  # in order: a resume reads the checkpoint an earlier run wrote
        hf_trainer_run.launch(one)
