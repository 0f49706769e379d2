"""A Fabric training loop under ``Fabric(strategy=D9DFabricStrategy(...))``, and the single-process PyTorch loop
(no Lightning, no DTensor) it is compared with.

Launched by the tests as ``python fabric_loop.py --fork '<json list of configs>'``: the ranks of each stretch of
configs with the same ``devices`` are forked from this process (``trainer_script.fork_ranks``), get torchrun's
environment, and run the configs one after the other. Rank 0 writes ``{"losses", "grad_norms", "params"}`` to
``config["out"]``.

A config: ``devices``, ``dims`` (the strategy's degrees), ``model`` ("qwen3", "moe", "litgpt", or the
``transformers`` "hf_qwen3" / "hf_qwen3_moe"), ``packed`` (rows of several documents), ``fused`` (the head fused
with the loss, off on CPU by default), ``pad`` (labels
partly ignored: ranks hold different numbers of tokens), ``clip`` (max norm; default a bound that never bites,
so that the norm is recorded and the gradient scale seen), ``meta_init`` (built under
``fabric.init_module(empty_init=True)``), ``setup`` ("joint": ``fabric.setup(model, optimizer)``; "module_first":
``setup_module`` then ``setup_optimizers``), ``save_at`` / ``ckpt`` (``fabric.save`` after that step),
``resume_from`` (``fabric.load`` before training), ``steps``. ``dims`` may hold the strategy's other options too
(``fp8``: the reference converts its decoder layers by hand, torchao's own conversion).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain_qwen3 import SyntheticCorpus
from reference import PaddedCorpus
from reference import packed_corpus as reference_packed_corpus
from trainer_script import fork_ranks, plain_name

from lightning_d9d import model_loss
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss

BASE = {"seed": 7, "seq_len": 16, "global_batch": 8, "samples": 64, "lr": 1e-3, "steps": 5}
NEVER_CLIPS = 1e9
VOCAB = Qwen3Config.tiny().vocab_size


def build_model(config: dict) -> nn.Module:
    kind = config.get("model", "qwen3")
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config.tiny())
    if kind == "moe":  # router losses on: they ride on the logits' backward
        return Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())
    if kind == "litgpt":
        from litgpt import GPT
        from litgpt import Config as LitConfig

        return GPT(
            LitConfig(
                n_layer=2,
                n_head=4,
                n_query_groups=2,
                n_embd=32,
                intermediate_size=64,
                block_size=BASE["seq_len"],
                vocab_size=VOCAB,
                padded_vocab_size=VOCAB,
                bias=False,
                norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP",
                parallel_residual=False,
                rotary_percentage=1.0,
            )
        )
    if kind in ("hf_qwen3", "hf_qwen3_moe"):  # a transformers model handed to fabric.setup whole: the adapter
        import transformers

        fields: dict[str, Any] = {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            # the reference runs the model as it is: with its default KV cache transformers skips the
            # packed-sequence check and documents would attend each other (the adapter turns it off itself)
            "use_cache": False,
        }
        if kind == "hf_qwen3":
            return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).train()
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields, **moe)).train()
    raise ValueError(f"unknown model {kind!r}")


class LogitsLoss:
    """``causal_lm_loss`` of a transformers output's logits, counted (token-weighted across ranks) as it is."""

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(output.logits, labels)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss.count(labels)


def loss_for(config: dict) -> Any:
    # causal_lm_loss itself reads a transformers output's logits; "fused" needs it (the head fused with the loss)
    hf = str(config.get("model", "")).startswith("hf_")
    return LogitsLoss() if hf and not config.get("fused") else causal_lm_loss


def corpus(config: dict) -> Dataset:
    if config.get("packed"):
        return packed_corpus(config)
    data = SyntheticCorpus(VOCAB, config["seq_len"], config["samples"])
    return PaddedCorpus(data) if config.get("pad") else data


def packed_corpus(config: dict) -> Dataset:
    """Documents of 2 to 40 tokens (the corpus's sequences cut at random lengths) packed into rows of
    ``seq_len``: rows hold several documents, long ones continue in the next row (the Trainer tests' data)."""
    return reference_packed_corpus(VOCAB, config["seq_len"], config["samples"])


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        plain_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
    }


def optimizer_for(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1, betas=(0.9, 0.95))


def scheduler_for(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The example's warmup then cosine (2 warmup steps of 8): a stateful object a checkpoint must carry."""

    def warmup_cosine(step: int) -> float:
        if step < 2:
            return (step + 1) / 2
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 2) / 6)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def model_inputs(batch: dict, config: dict) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """The ids, and for packed rows the positions that restart per document: by keyword for a transformers
    model (its forward's second parameter is attention_mask)."""
    if "position_ids" in batch and str(config.get("model", "")).startswith("hf_"):
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if "position_ids" in batch:
        return batch["input_ids"], batch["position_ids"]
    return (batch["input_ids"],)


def call(model: nn.Module, inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def rows_of(
    inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor], rank: int, dp: int
) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """Data rank ``rank``'s rows of the global batch: rows ``rank``, ``rank + dp``, ..."""
    if isinstance(inputs, dict):
        return {key: value[rank::dp] for key, value in inputs.items()}
    return tuple(t[rank::dp] for t in inputs)


# ------------------------------------------------------------------------------------------ the Fabric loop
def set_up(
    fabric: L.Fabric,
    model: nn.Module,
    config: dict,
    make_optimizer: Callable[[nn.Module, dict], torch.optim.Optimizer],
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The model and its optimizer set up as ``config["setup"]`` says ("joint": ``fabric.setup(model,
    optimizer)``; else module first, then the optimizer), the loader of this data rank's share of the global
    batch, and the state a checkpoint saves (model, optimizer, scheduler, step)."""
    if config.get("setup", "joint") == "joint":
        model, optimizer = fabric.setup(model, make_optimizer(model, config))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model, config))
    dp = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    loader = fabric.setup_dataloaders(
        DataLoader(corpus(config), batch_size=config["global_batch"] // dp, shuffle=True)
    )
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler_for(optimizer), "step": 0}
    return model, optimizer, loader, state


def fabric_run(config: dict) -> None:
    fabric = L.Fabric(
        accelerator=config.get("accelerator", "cpu"),
        devices=config["devices"],
        strategy=D9DFabricStrategy(**config.get("dims", {})),
        precision=config.get("precision", "32-true"),
    )
    fabric.launch()
    fabric.seed_everything(config["seed"], verbose=False)
    with fabric.init_module(empty_init=bool(config.get("meta_init"))):
        model = build_model(config)
    if config.get("fused"):  # the fused head + loss, which CPU leaves off by default
        model.fuse_head_loss = True
    model, optimizer, loader, state = set_up(fabric, model, config, optimizer_for)
    if config.get("resume_from"):
        fabric.load(config["resume_from"], state)
    step, losses, norms = int(state["step"]), [], []
    loss_fn = loss_for(config)
    clip = config.get("clip", NEVER_CLIPS)
    while step < config["steps"]:
        for index, batch in enumerate(loader):
            if index < step % len(loader):  # a resumed run picks up inside the epoch
                continue
            loss = model_loss(fabric, model, model_inputs(batch, config), batch["labels"], loss_fn)
            fabric.backward(loss)
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))  # before clipping
            optimizer.step()
            state["scheduler"].step()
            optimizer.zero_grad()
            # every data rank's weighed loss: their mean is the global batch's token mean
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
            step += 1
            if step == config.get("save_at"):
                state["step"] = step
                fabric.save(config["ckpt"], state)
            if step == config["steps"]:
                break
    params = full_parameters(model.module)  # the user's module: its own names
    if fabric.global_rank == 0:
        torch.save({"losses": losses, "grad_norms": norms, "params": params}, config["out"])
    fabric.barrier()


def run_each(configs: list[dict], run: Callable[[dict], None]) -> None:
    """``run`` on each config in turn on this rank (a forked rank of ``fork_ranks``), naming the failing one."""
    for config in configs:
        try:
            run(config)
        except BaseException as error:
            error.add_note(f"in the run that writes {config['out']}")
            raise
    if dist.is_initialized():
        dist.destroy_process_group()


def run_all(configs: list[dict]) -> None:
    run_each(configs, fabric_run)


# ---------------------------------------------------------------------------------------- the reference
def reference_run(config: dict, dp: int, device: str = "cpu") -> dict:
    """One process, global batches, plain PyTorch. ``dp``: how many data ranks the compared run has (an MoE's
    router losses are each rank's own, not linear in the batch: each rank's rows run on their own)."""
    config = {**BASE, **config}
    torch.manual_seed(config["seed"])
    model = build_model(config).to(device)
    fp8 = config.get("dims", {}).get("fp8")
    if fp8 is not None:
        from float8_training import convert_by_hand

        convert_by_hand(model.model.layers, fp8)
    optimizer = optimizer_for(model, config)
    scheduler = scheduler_for(optimizer)
    train = corpus(config)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=config["seed"])
    moe = isinstance(model, Qwen3MoeForCausalLM)
    if moe:
        model.set_router_loss_scale(1 / dp)
    losses, norms, step, epoch = [], [], 0, 0
    while step < config["steps"]:
        sampler.set_epoch(epoch)
        for batch in DataLoader(train, batch_size=config["global_batch"], sampler=sampler):
            inputs = model_inputs({key: value.to(device) for key, value in batch.items()}, config)
            labels = batch["labels"].to(device)
            # each rank's rows on their own: an MoE's router losses are each rank's, and float8 scales an
            # activation over the rows a matmul sees; rank r's batch is rows r, r + dp, ... of the global batch
            if moe or fp8 is not None:
                counts = torch.stack([(labels[r::dp] != -100).sum() for r in range(dp)])
                parts = [
                    loss_for(config)(call(model, rows_of(inputs, r, dp)), labels[r::dp]) for r in range(dp)
                ]
                loss = (torch.stack(parts) * counts).sum() / counts.sum()  # the token mean over the ranks
            else:
                loss = loss_for(config)(call(model, inputs), labels)
            loss.backward()
            norms.append(
                float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.get("clip", NEVER_CLIPS)))
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step == config["steps"]:
                break
        epoch += 1
    return {"losses": losses, "grad_norms": norms, "params": full_parameters(model)}


if __name__ == "__main__":
    assert sys.argv[1] == "--fork", "usage: fabric_loop.py --fork '<json list of configs>'"
    sys.exit(fork_ranks(json.loads(sys.argv[2]), run=run_all))
