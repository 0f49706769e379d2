"""``fabric_loop.py``'s Fabric loop with our optimizers (``Muon``, ``StochasticAdamW``), and the one-process loop
it is compared with.

Launched by the tests as ``python fabric_optim_loop.py --fork '<json list of configs>'`` (the ranks forked by
``trainer_script.fork_ranks``, one stretch per world size). A config: fabric_loop's ``devices``, ``dims``,
``model``, ``meta_init``, ``setup``, ``clip``, ``save_at`` / ``ckpt``, ``resume_from``, ``steps``, and
``optimizer`` (``"muon"``: ``Muon(muon_param_groups(model))`` in fp32; ``"stochastic_adamw"``: ``StochasticAdamW``
over bf16 parameters, ``precision="bf16-true"``). Rank 0 writes to ``config["out"]``: the losses, the gradient
norms before clipping, the final parameters and optimizer state (every tensor whole, by parameter name), the
clipping coefficient each step left pending in the optimizer (``StochasticAdamW``: norm clipping hands it to the
step instead of rewriting the bf16 gradients), and the parameters and state right after ``fabric.save`` (``saved``)
or ``fabric.load`` (``loaded``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from fabric_loop import (
    BASE,
    NEVER_CLIPS,
    build_model,
    call,
    corpus,
    full_parameters,
    loss_for,
    model_inputs,
    rows_of,
    run_each,
    scheduler_for,
    set_up,
)
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from trainer_script import fork_ranks, plain_name

from lightning_d9d import model_loss
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.models import Qwen3MoeForCausalLM
from lightning_d9d.optim import Muon, StochasticAdamW, muon_param_groups

PRECISION = {"muon": "32-true", "stochastic_adamw": "bf16-true"}


def optimizer_for(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    """What a user writes: Muon over ``muon_param_groups(model)``, or StochasticAdamW over the bf16 parameters."""
    if config["optimizer"] == "muon":
        return Muon(muon_param_groups(model), lr=config["lr"], weight_decay=0.1)
    assert config["optimizer"] == "stochastic_adamw", config["optimizer"]
    return StochasticAdamW(
        model.parameters(),
        lr=config["lr"],
        betas=(0.9, 0.95),
        weight_decay=0.1,
        master_weights=bool(config.get("master_weights")),
        seed=int(config.get("rounding_seed", 0)),
    )


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state whole (DTensors gathered: every rank calls this), by the parameter's plain name, and
    its groups' settings."""
    names = {id(param): plain_name(name) for name, param in module.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for param, entries in optimizer.state.items():
        state[names[id(param)]] = {
            key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
            for key, value in sorted(entries.items())
        }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "groups": groups}


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters in their own dtype and the optimizer's state, whole: what a resume must put back bit for bit."""
    params = {
        plain_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for name, p in module.named_parameters()
    }
    return {"params": params, **full_state(module, optimizer)}


# ------------------------------------------------------------------------------------------ the Fabric loop
def fabric_run(config: dict) -> None:
    fabric = L.Fabric(
        accelerator="cpu",
        devices=config["devices"],
        strategy=D9DFabricStrategy(**config.get("dims", {})),
        precision=PRECISION[config["optimizer"]],
    )
    fabric.launch()
    fabric.seed_everything(config["seed"], verbose=False)
    with fabric.init_module(empty_init=bool(config.get("meta_init"))):
        model = build_model(config)
    model, optimizer, loader, state = set_up(fabric, model, config, optimizer_for)
    result: dict[str, Any] = {}
    if config.get("resume_from"):
        fabric.load(config["resume_from"], state)
        result["loaded"] = snapshot(model.module, optimizer.optimizer)
    step, losses, norms, pending = int(state["step"]), [], [], []
    loss_fn = loss_for(config)
    clip = config.get("clip", NEVER_CLIPS)
    while step < config["steps"]:
        for index, batch in enumerate(loader):
            if index < step % len(loader):  # a resumed run picks up inside the epoch
                continue
            loss = model_loss(fabric, model, model_inputs(batch, config), batch["labels"], loss_fn)
            fabric.backward(loss)
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))  # before clipping
            scale = getattr(optimizer.optimizer, "_grad_scale", None)
            pending.append(None if scale is None else float(scale))
            optimizer.step()
            state["scheduler"].step()
            optimizer.zero_grad()
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
            step += 1
            if step == config.get("save_at"):
                state["step"] = step
                fabric.save(config["ckpt"], state)
                result["saved"] = snapshot(model.module, optimizer.optimizer)
            if step == config["steps"]:
                break
    result.update(
        losses=losses,
        grad_norms=norms,
        pending=pending,
        params=full_parameters(model.module),
        final=snapshot(model.module, optimizer.optimizer),
    )
    if fabric.global_rank == 0:
        torch.save(result, config["out"])
    fabric.barrier()


def run_all(configs: list[dict]) -> None:
    run_each(configs, fabric_run)


# ---------------------------------------------------------------------------------------- the reference
def reference_run(config: dict, dp: int) -> dict:
    """One process, global batches, plain PyTorch with the same optimizer (bf16 parameters for StochasticAdamW).
    Clipping is torch's, which rewrites the gradients (in bf16 for StochasticAdamW): a reference that does not
    lean on the pending scale it checks. ``dp``: the compared run's data ranks (an MoE's router losses are each
    rank's own: each rank's rows run on their own)."""
    config = {**BASE, **config}
    torch.manual_seed(config["seed"])
    model = build_model(config)
    if PRECISION[config["optimizer"]] == "bf16-true":
        model.to(torch.bfloat16)
    initial = full_parameters(model)
    optimizer = optimizer_for(model, config)
    scheduler = scheduler_for(optimizer)
    train = corpus(config)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=config["seed"])
    moe = isinstance(model, Qwen3MoeForCausalLM)
    if moe:
        model.set_router_loss_scale(1 / dp)
    clip = config.get("clip", NEVER_CLIPS)
    losses, norms, step, epoch = [], [], 0, 0
    while step < config["steps"]:
        sampler.set_epoch(epoch)
        for batch in DataLoader(train, batch_size=config["global_batch"], sampler=sampler):
            inputs, labels = model_inputs(batch, config), batch["labels"]
            if moe:  # rank r's batch is rows r, r + dp, ... of the global batch
                counts = torch.stack([(labels[r::dp] != -100).sum() for r in range(dp)])
                parts = [causal_lm_loss_of(model, rows_of(inputs, r, dp), labels[r::dp]) for r in range(dp)]
                loss = (torch.stack(parts) * counts).sum() / counts.sum()
            else:
                loss = causal_lm_loss_of(model, inputs, labels)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step == config["steps"]:
                break
        epoch += 1
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": full_parameters(model),
        "initial": initial,
        **full_state(model, optimizer),
    }


def causal_lm_loss_of(model: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
    return loss_for({})(call(model, inputs), labels)


if __name__ == "__main__":
    assert sys.argv[1] == "--fork", "usage: fabric_optim_loop.py --fork '<json list of configs>'"
    sys.exit(fork_ranks(json.loads(sys.argv[2]), run=run_all))
