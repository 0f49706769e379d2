"""A LoRA Fabric loop (``D9DFabricStrategy(lora=...)``) that loads its base from a Hugging Face folder itself, as a
Fabric user does, saves adapters-only checkpoints and resumes from them.

Launched by ``test_fabric_lora.py`` as ``python fabric_lora_loop.py --fork '<json list of configs>'`` (the ranks
forked by ``trainer_script.fork_ranks``). A config: ``devices``, ``dims``, ``base`` (the folder the base is loaded
from), ``shape`` (the tiny Qwen3's sizes), ``steps``, ``save_at`` / ``ckpt`` (``fabric.save`` after that step), ``resume_from`` (``fabric.load``
before training), ``expect_refusal`` (the load must fail: rank 0 writes the error's message). Rank 0 writes
``{"params", "optimizer"}`` (full tensors) or ``{"refusal"}`` to ``config["out"]``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from fabric_loop import BASE, corpus, full_parameters, model_inputs, run_each
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from trainer_script import fork_ranks, plain_name

from lightning_d9d import LoRA, model_loss
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.state import CheckpointError
from lightning_d9d.state.hf import load_hf

ADAPTERS = {"rank": 4, "alpha": 8.0}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each trained parameter's AdamW moments and step count, whole, by the parameter's name."""
    names = {id(p): plain_name(name) for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{names[id(param)]}.{key}"] = whole.detach().float().cpu().clone()
    return out


def lora_run(config: dict) -> None:
    fabric = L.Fabric(
        accelerator="cpu",
        devices=config["devices"],
        strategy=D9DFabricStrategy(lora=LoRA(**ADAPTERS), **config.get("dims", {})),
        precision="32-true",
    )
    fabric.launch()
    fabric.seed_everything(config["seed"], verbose=False)
    with fabric.init_module(empty_init=True):
        model = Qwen3ForCausalLM(Qwen3Config.tiny(**config["shape"]))
    model = fabric.setup_module(model)
    load_hf(model.module, config["base"])  # the base, from its folder: Fabric has no LoadHFWeights callback
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trained, lr=1e-2))
    dp = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    loader = fabric.setup_dataloaders(
        DataLoader(corpus(config), batch_size=config["global_batch"] // dp, shuffle=True)
    )
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if config.get("resume_from"):
        try:
            fabric.load(config["resume_from"], state)
        except CheckpointError as error:
            if not config.get("expect_refusal"):
                raise
            if fabric.global_rank == 0:
                torch.save({"refusal": str(error)}, config["out"])
            fabric.barrier()
            return
        assert not config.get("expect_refusal"), "a load onto another base was not refused"
    step = int(state["step"])
    while step < config["steps"]:
        for index, batch in enumerate(loader):
            if index < step % len(loader):  # a resumed run picks up inside the epoch
                continue
            loss = model_loss(fabric, model, model_inputs(batch, config), batch["labels"], causal_lm_loss)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == config.get("save_at"):
                state["step"] = step
                fabric.save(config["ckpt"], state)
            if step == config["steps"]:
                break
    params, moments = full_parameters(model.module), optimizer_state(model.module, optimizer)
    if fabric.global_rank == 0:
        torch.save({"params": params, "optimizer": moments}, config["out"])
    fabric.barrier()


def run_all(configs: list[dict]) -> None:
    run_each(configs, lambda config: lora_run({**BASE, **config}))


if __name__ == "__main__":
    assert sys.argv[1] == "--fork", "usage: fabric_lora_loop.py --fork '<json list of configs>'"
    sys.exit(fork_ranks(json.loads(sys.argv[2]), run=run_all))
