"""Where a training step of the MoE benchmark shape goes on the GPU: ``torch.profiler`` over a few steps.

Our Qwen3-MoE (or transformers' with ``--hf``) as ``train_throughput.py``'s plain-loop FSDP paths build it
(FSDP2 bf16 MixedPrecisionPolicy on one rank, per-decoder-layer compile, fused AdamW), ``--warmup`` steps, then
``--steps`` profiled steps; prints the CUDA kernels by total time and writes a Chrome trace under ``--out``.

    PYTHONPATH=. python benchmarks/profile_moe.py --out runs/profile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import build_model, parse_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", action="store_true", help="profile transformers' Qwen3-MoE instead of ours")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("runs/profile"))
    own = parser.parse_args()
    args = parse_args(["--model", "moe", "--seq-len", "4096", "--batch-size", "4"])
    path = "hf_fsdp_compiled" if own.hf else "ours_fsdp_compiled"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model, forward = build_model(path, args, device)
    from lightning_d9d.modules.loss import causal_lm_loss

    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
    inputs, labels = ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with torch.profiler.record_function("forward+loss"):
            loss = causal_lm_loss(forward(inputs), labels)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(own.warmup):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(own.steps):
            step()
        torch.cuda.synchronize()
    own.out.mkdir(parents=True, exist_ok=True)
    profile.export_chrome_trace(str(own.out / f"{path}.json"))
    averages = profile.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=own.rows, max_name_column_width=70)
    except (AttributeError, KeyError, ValueError):  # older torch names it after CUDA
        table = averages.table(sort_by="self_cuda_time_total", row_limit=own.rows, max_name_column_width=70)
    (own.out / f"{path}.txt").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
