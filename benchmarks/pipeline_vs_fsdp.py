"""Step time of the example model on 2 GPUs: pipeline (pp=2) against FSDP (dp_shard=2), same global batch.

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_vs_fsdp.py --pp 2 --schedule 1F1B
    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_vs_fsdp.py --pp 1

Prints one JSON line (rank 0): median step time, tokens/s, MFU against the H200's 989 TFLOP/s dense bf16
peak (model FLOPs = ``Qwen3ForCausalLM.num_flops_per_token(seq_len)`` x tokens), and peak memory per GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pretrain_qwen3 import Qwen3Pretraining

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM

H200_BF16_DENSE_FLOPS = 989e12


class RandomTokens(Dataset):
    def __init__(self, vocab: int, seq_len: int, samples: int) -> None:
        self.vocab, self.seq_len, self.samples = vocab, seq_len, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(
            0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index)
        )
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class StepTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    config = Qwen3Config.qwen3_0_6b(tie_word_embeddings=False)  # a tied head cannot be split over stages
    devices = torch.cuda.device_count()
    dp = devices // args.pp
    strategy = D9DStrategy(
        pp=args.pp, pipeline_schedule=args.schedule, microbatches=args.microbatches if args.pp > 1 else None
    )
    timer = StepTimer()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
    )
    module = Qwen3Pretraining(config, lr=1e-4, warmup_steps=1, max_steps=args.steps)
    data = RandomTokens(config.vocab_size, args.seq_len, args.global_batch * args.steps)
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(data, batch_size=args.global_batch // dp, num_workers=2))
    step = statistics.median(timer.times[args.warmup :])
    tokens = args.global_batch * args.seq_len
    assert isinstance(module.model, Qwen3ForCausalLM)
    per_token = module.model.num_flops_per_token(args.seq_len)  # from the config: the whole model, any stage
    memory = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(memory, op=torch.distributed.ReduceOp.MAX)
    if trainer.is_global_zero:
        print(
            json.dumps(
                {
                    "layout": f"pp={args.pp} {args.schedule} mb={args.microbatches}"
                    if args.pp > 1
                    else f"dp_shard={dp}",
                    "gpus": devices,
                    "seq_len": args.seq_len,
                    "global_batch": args.global_batch,
                    "step_s_median": round(step, 4),
                    "tokens_per_s": round(tokens / step),
                    "mfu": round(per_token * tokens / step / (devices * H200_BF16_DENSE_FLOPS), 4),
                    "peak_mem_gib_max_rank": round(float(memory), 2),
                    "torch": torch.__version__,
                    "lightning": L.__version__,
                    "gpu": torch.cuda.get_device_name(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
