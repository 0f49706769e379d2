"""``Trainer(strategy=D9DStrategy(tp=...))`` on a LightningModule around a transformers causal LM, on N ranks forked
from this process with the environment torchrun gives (so Lightning launches nothing itself).

Usage: ``python hf_trainer_run.py '<json run>'`` with ``family``, ``tied``, ``devices``, ``dims`` (the strategy's
degrees), ``out``; rank 0 saves the losses and the final parameters there.
The strategy itself picks the adapter's plan (``D9DStrategy._parallelize`` asks ``hf_plan_for``); the test checks
that the plan was applied (a split ``q_proj``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch._dynamo
import torch.distributed.tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "callbacks"), str(HERE)]
import trainer_runs  # noqa: E402
from test_hf_tensor_parallel import ROWS, STEPS, batch, tiny_model  # noqa: E402

from lightning_d9d import D9DStrategy, model_loss  # noqa: E402
from lightning_d9d.modules.loss import causal_lm_loss  # noqa: E402


class LogitsLoss:
    """``causal_lm_loss`` of a transformers output's logits: a counted loss (token-weighted across ranks)."""

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(output.logits, labels)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss.count(labels)


class HFCausalLM(L.LightningModule):
    def __init__(self, family: str, tied: bool) -> None:
        super().__init__()
        self.model = tiny_model(family, tied)
        self.loss_fn = LogitsLoss()
        self.losses: list[float] = []

    def on_train_start(self) -> None:
        self.start = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in self.model.named_parameters()
        }

    def training_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = model_loss(self, self.model, (data["input_ids"],), data["labels"], self.loss_fn)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # as the reference (test_hf_tensor_parallel.train)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)


def samples() -> list[dict[str, torch.Tensor]]:
    rows = []
    for step in range(STEPS):
        ids, labels = batch(step)
        rows += [{"input_ids": ids[r], "labels": labels[r]} for r in range(ROWS)]
    return rows


def fit(run: dict[str, Any]) -> None:
    module = HFCausalLM(run["family"], run["tied"])
    trainer = L.Trainer(
        strategy=D9DStrategy(**run["dims"]),
        accelerator="cpu",
        devices=run["devices"],
        precision="32-true",
        max_steps=STEPS,
        gradient_clip_val=1e6,  # the clipping path runs, and never bites
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # Lightning's distributed sampler shuffles every training loader; with dp = 1 each rank reads it all
        use_distributed_sampler=False,
    )
    if run["devices"] != run["dims"].get("tp", 1):
        raise ValueError("the script feeds every rank the whole batch: tp only (dp = 1)")
    trainer.fit(module, DataLoader(samples(), batch_size=ROWS, shuffle=False))
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.model.named_parameters()
    }
    q_proj = module.model.model.layers[0].self_attn.q_proj.weight
    plan = {
        "logits_sharded": isinstance(module.model.lm_head.weight, DTensor),
        # the strategy chose the adapter's plan, not the default (FSDP only): q_proj's rows split over tp
        "q_proj_split": isinstance(q_proj, DTensor)
        and "tp" in (q_proj.device_mesh.mesh_dim_names or ())
        and q_proj.to_local().shape[0] * run["dims"]["tp"] == q_proj.shape[0],
        "tied": module.model.lm_head.weight is module.model.model.embed_tokens.weight,
    }
    if trainer.is_global_zero:
        torch.save({"losses": module.losses, "params": params, "start": module.start, **plan}, run["out"])


def launch(run: dict[str, Any], timeout: float = 200) -> None:
    """``fit(run)`` on ``run["devices"]`` forked ranks (``trainer_runs``' launcher; ``fit`` is looked up when a
    rank starts, so a script that sets ``hf_trainer_run.fit`` runs its own)."""
    trainer_runs.KINDS["transformers"] = lambda one: fit(one)
    trainer_runs.launch({**run, "kind": "transformers"}, timeout=timeout)


if __name__ == "__main__":
    launch(json.loads(sys.argv[1]))
