"""Pretrain a tiny Qwen3 with a Fabric loop of one's own under ``Fabric(strategy="d9d")``.

    python examples/fabric_pretrain_qwen3.py                          # 2 CPU processes, FSDP
    python examples/fabric_pretrain_qwen3.py --tp 2                   # tensor parallel instead
    python examples/fabric_pretrain_qwen3.py --resume runs/fabric/ckpt --max-steps 40   # continue a run

The loop is plain Fabric; three lines are the strategy's: ``D9DFabricStrategy(...)`` (the degrees),
``model_loss(fabric, ...)`` (the loss computed on the mesh: cp split, token-weighted ranks, vocabulary-parallel
cross-entropy) and ``fabric.save`` / ``fabric.load`` writing the Trainer's atomic checkpoint format (resumable on
another layout: ``--resume`` with other degrees or devices).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_qwen3 import SyntheticCorpus

from lightning_d9d import model_loss
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output", default="runs/fabric")
    parser.add_argument("--resume", default=None, help="a checkpoint written by this script")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    strategy = D9DFabricStrategy(dp_shard=args.dp_shard, tp=args.tp, cp=args.cp)
    fabric = L.Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(1234)
    config = Qwen3Config.tiny()
    with fabric.init_module(empty_init=True):  # on meta: memory comes after sharding, one seed for all ranks
        model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer follows the sharded parameters

    data_ranks = strategy.distributed_sampler_kwargs["num_replicas"]  # tp and cp peers share a batch
    corpus = SyntheticCorpus(config.vocab_size, args.seq_len, args.global_batch * args.max_steps)
    loader = fabric.setup_dataloaders(
        DataLoader(corpus, batch_size=args.global_batch // data_ranks, shuffle=True)
    )
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # every file checked first; DCP reshards onto this layout
        fabric.print(f"resumed at step {state['step']} from {args.resume}")

    started, step = time.perf_counter(), int(state["step"])
    while step < args.max_steps:
        for index, batch in enumerate(loader):
            if index < step % len(loader):  # a resumed run continues inside its epoch
                continue
            loss = model_loss(fabric, model, (batch["input_ids"],), batch["labels"], causal_lm_loss)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == args.max_steps:
                mean = fabric.all_reduce(loss.detach(), reduce_op="mean")  # the global batch's token mean
                fabric.print(f"step {step:4d}  loss {float(mean):.4f}  {time.perf_counter() - started:.1f} s")
            if step == args.max_steps:
                break
    state["step"] = step
    checkpoint = Path(args.output) / "ckpt"
    fabric.save(checkpoint, state)  # atomic: complete under its name, or not there at all
    fabric.print(f"saved {checkpoint}")


if __name__ == "__main__":
    main()
