"""The single-process PyTorch loop that every Trainer run is compared with (no Lightning, no DTensor)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from plain_module import build_plain_model
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss


def reference_run(config: dict) -> dict:
    """Train like the Trainer should: same init seed, same global batches, same optimizer and schedule."""
    seed, accumulate = config["seed"], config.get("accumulate", 1)
    torch.manual_seed(seed)
    model_config = Qwen3Config.tiny(**config.get("model", {}))
    module = Qwen3Pretraining(
        model_config, lr=config["lr"], warmup_steps=2, max_steps=config["schedule_steps"]
    )
    if config.get("plain_module"):
        module.model = build_plain_model(model_config.vocab_size, rank=0)  # type: ignore[assignment]
    else:
        module.model = Qwen3ForCausalLM(model_config)  # eager init, the meta-device path must match it
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    global_batch = config["global_batch"]
    train = SyntheticCorpus(
        model_config.vocab_size, config["seq_len"], global_batch * config["steps_per_epoch"]
    )
    # One replica of Lightning's sampler: each global batch holds the same samples as the dp ranks' batches.
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    losses: list[float] = []
    grad_norms: list[float] = []
    micro_steps = config["max_steps"] * accumulate
    epoch = 0
    while len(losses) < micro_steps:
        sampler.set_epoch(epoch)
        for batch in DataLoader(train, batch_size=global_batch, sampler=sampler):
            loss = causal_lm_loss(module.model(batch["input_ids"]), batch["labels"])
            losses.append(loss.item())
            (loss / accumulate).backward()
            if len(losses) % accumulate == 0:
                if config.get("clip"):
                    grad_norms.append(
                        float(torch.nn.utils.clip_grad_norm_(module.parameters(), config["clip"]))
                    )
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if len(losses) == micro_steps:
                break
        epoch += 1
    result: dict = {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }
    if config.get("validate"):
        val = SyntheticCorpus(
            model_config.vocab_size, config["seq_len"], global_batch * 2, first_sample=10_000
        )
        with torch.no_grad():
            val_losses = [
                causal_lm_loss(module.model(b["input_ids"]), b["labels"]).item()
                for b in DataLoader(val, batch_size=global_batch)
            ]
        result["val_loss"] = sum(val_losses) / len(val_losses)
    return result
