"""Where a training step goes on the GPU: ``torch.profiler`` over a few steps of one benchmark path.

The model as ``train_throughput.py``'s plain-loop paths build it (``--path``: ``ours_fsdp_compiled`` is our model
parallelized as the strategy does it, FSDP2 bf16 mixed precision on one rank and per-block compile;
``hf_fsdp_compiled`` is the transformers baseline), the loss as the Trainer computes it (our fused LM head +
cross-entropy on CUDA; the logits path for transformers), fused AdamW. ``--warmup`` steps, then ``--steps``
profiled steps; prints the CUDA kernels by total time, the GPU time per step, and writes a Chrome trace.

    PYTHONPATH=. python benchmarks/profile_step.py --model moe --out runs/profile
    PYTHONPATH=. python benchmarks/profile_step.py --model moe --path hf_fsdp_compiled --out runs/profile
    PYTHONPATH=. python benchmarks/profile_step.py --model moe --path ours_compiled --master-weights --out runs/profile
    PYTHONPATH=. python benchmarks/profile_step.py --model 4b --path ours_fsdp_compiled --out runs/profile4b
    PYTHONPATH=. python benchmarks/profile_step.py --model 4b --layers 18 --path ours_compiled --out runs/profile4b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gaps import profile_report
from train_throughput import QWEN3_SHAPES, build_model, parse_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["0.6b", *QWEN3_SHAPES, "moe"], default="moe")
    parser.add_argument("--path", default="ours_fsdp_compiled")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    # fewer decoder layers of the same shape: the per-layer kernels are the same, so a half-depth 4B fits 80 GB
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    parser.add_argument("--out", type=Path, default=Path("runs/profile"))
    parser.add_argument(
        "--master-weights",
        action="store_true",
        help="bf16 parameters with fp32 masters (MasterWeightAdamW) instead of fused AdamW; paths without FSDP",
    )
    own = parser.parse_args()
    shape = ["--model", own.model, "--layers", str(own.layers)]
    args = parse_args([*shape, "--seq-len", str(own.seq_len), "--batch-size", str(own.batch_size)])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model, forward = build_model(own.path, args, device)
    from lightning_d9d.models.causal_lm import fused_causal_lm_loss
    from lightning_d9d.modules.loss import CausalLMLoss

    loss_fn = CausalLMLoss()
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
    inputs, labels = ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    autocast = "fsdp" not in own.path  # the plain loops without FSDP autocast, as train_throughput.py
    optimizer: torch.optim.Optimizer
    if own.master_weights:
        if not autocast:
            raise SystemExit("--master-weights needs a path without FSDP (its parameters become bf16)")
        from lightning_d9d.optim import MasterWeightAdamW

        optimizer = MasterWeightAdamW(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with (
            torch.profiler.record_function("forward+loss"),
            torch.autocast("cuda", torch.bfloat16, enabled=autocast),
        ):
            loss = fused_causal_lm_loss(model, (inputs,), labels, loss_fn)
            if loss is None:
                loss = loss_fn(forward(inputs), labels)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(own.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(own.steps):
        step()
    torch.cuda.synchronize()
    unprofiled_ms = (time.perf_counter() - start) * 1e3 / own.steps
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(own.steps):
            step()
        torch.cuda.synchronize()
    own.out.mkdir(parents=True, exist_ok=True)
    name = f"{own.model}_{own.path}" + (f"_{own.layers}layers" if own.layers else "")
    name += "_master" if own.master_weights else ""
    profile.export_chrome_trace(str(own.out / f"{name}.json"))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    text = f"{name}: {unprofiled_ms:.1f} ms/step wall (unprofiled), peak {peak:.2f} GiB\n"
    text += profile_report(profile, own.steps, own.rows)
    (own.out / f"{name}.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
