"""``Trainer(strategy=D9DStrategy(cp=...))`` on a LightningModule around a transformers causal LM, on N ranks forked
from this process (``hf_trainer_run.py``'s module, launcher and data, with a fit of its own for cp).

Usage: ``python hf_context_trainer_run.py '<json run>'`` with ``family``, ``tied``, ``devices``, ``dims``, ``out``
(and ``fused``: ``causal_lm_loss`` itself, which the strategy fuses with the head);
rank 0 saves the global token-mean losses, the final parameters and what the plan set up there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import hf_trainer_run  # noqa: E402
from hf_trainer_run import ROWS, STEPS, HFCausalLM, samples  # noqa: E402

from lightning_d9d import D9DStrategy  # noqa: E402
from lightning_d9d.modules.loss import causal_lm_loss  # noqa: E402


def fit(run: dict[str, Any]) -> None:
    if run["devices"] != run["dims"].get("cp", 1):
        raise ValueError("the script feeds every rank the whole batch: cp only (dp = 1)")
    module = HFCausalLM(run["family"], run["tied"])
    if run.get("fused"):
        # the fused head + loss runs the base model itself (models/hf/loss.py): no logits, no lm_head forward
        module.loss_fn = causal_lm_loss  # type: ignore[assignment]
        module.model.fuse_head_loss = True
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
        use_distributed_sampler=False,  # the cp ranks of one replica read the same batches
    )
    trainer.fit(module, DataLoader(samples(), batch_size=ROWS, shuffle=False))
    # each rank's loss is its tokens' sum over the global batch's, times cp (model_loss weighs by tokens)
    losses = torch.tensor(module.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.model.named_parameters()
    }
    if trainer.is_global_zero:
        torch.save(
            {
                "losses": (losses / run["devices"]).tolist(),
                "params": params,
                "implementation": module.model.config._attn_implementation,
                "tied": module.model.lm_head.weight is module.model.model.embed_tokens.weight,
            },
            run["out"],
        )


if __name__ == "__main__":
    hf_trainer_run.fit = fit  # its rank entry point calls the module's fit
    hf_trainer_run.launch(json.loads(sys.argv[1]))
