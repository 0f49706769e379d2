"""What one optimizer step and its casts cost, fp32 parameters under autocast against ``MasterWeightAdamW``.

    PYTHONPATH=. python benchmarks/master_weights_speed.py [--model moe|0.6b|4b] [--out result.json]

The parameters of the benchmark model's shape (built on meta, then one tensor per parameter on the GPU), two ways:
- **autocast**: fp32 parameters; per step, each weight cast to bf16 (autocast's copy in forward), a bf16 gradient
  cast to fp32 (autocast's cast backward), and torch's fused AdamW over fp32 parameters and gradients;
- **master**: bf16 parameters with bf16 gradients, ``MasterWeightAdamW``'s step (the Triton kernel).
Only the bytes outside the matmuls differ between the two, so this is the lever's size; the whole step's
difference is ``train_throughput.py``'s ``ours_trainer_compiled_nofsdp_master`` path. Median of CUDA-event times.
One H200, the MoE shape (1.62 B parameters; docs/benchmarks.md, run G5): 21.3 ms against 15.6 ms (5.8 ms a step
less; each at ~3 TB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput

from lightning_d9d.models import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.optim import MasterWeightAdamW


def shapes(model: str) -> list[torch.Size]:
    config = train_throughput._config(argparse.Namespace(model=model, layers=None))
    with torch.device("meta"):
        built = (
            Qwen3MoeForCausalLM(config) if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM(config)
        )
    return [param.shape for param in built.parameters()]


def median_ms(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        if i >= 2:  # the first two: Triton's compile, allocator warm-up
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_autocast(
    params: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device, repeats: int
) -> float:
    fp32 = [torch.nn.Parameter(p.clone()) for p in params]
    adamw = torch.optim.AdamW(fp32, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step() -> None:
        for param, grad in zip(fp32, grads, strict=True):
            param.detach().to(torch.bfloat16)  # autocast's copy of the weight in forward
            param.grad = grad.to(torch.float32)  # autocast's cast of the gradient in backward
        adamw.step()

    return median_ms(step, device, repeats)


def time_master(
    params: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device, repeats: int
) -> float:
    bf16 = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = MasterWeightAdamW(bf16, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for param, grad in zip(bf16, grads, strict=True):
        param.grad = grad
    return median_ms(optimizer.step, device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    sizes = shapes(args.model)
    numel = sum(s.numel() for s in sizes)
    torch.manual_seed(0)

    params = [torch.randn(s, device=device) * 0.02 for s in sizes]
    grads_bf16 = [torch.randn(s, device=device, dtype=torch.bfloat16) * 1e-3 for s in sizes]
    autocast_ms = time_autocast(params, grads_bf16, device, args.repeats)
    torch.cuda.empty_cache()
    master_ms = time_master(params, grads_bf16, device, args.repeats)
    result = {
        "model": args.model,
        "parameters": numel,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "autocast_casts_plus_fused_adamw_ms": autocast_ms,
        "master_weight_step_ms": master_ms,
        "saved_ms": autocast_ms - master_ms,
        # bytes each way: 28 + 12 a parameter against 28
        "autocast_tb_per_s": 40 * numel / autocast_ms / 1e9,
        "master_tb_per_s": 28 * numel / master_ms / 1e9,
    }
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
