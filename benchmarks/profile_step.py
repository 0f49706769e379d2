"""Where a training step goes on the GPU: ``torch.profiler`` over a few steps of one benchmark path.

The model as ``train_throughput.py``'s plain-loop paths build it (``--path``: ``ours_fsdp_compiled`` is our model
parallelized as the strategy does it, FSDP2 bf16 mixed precision on one rank and per-block compile;
``hf_fsdp_compiled`` is the transformers baseline; ``peft_fsdp_compiled`` the LoRA baseline), the loss as the
Trainer computes it (our fused LM head + cross-entropy on CUDA; the logits path for transformers), fused AdamW over
the parameters that train. ``--warmup`` steps, then ``--steps`` profiled steps; prints where the step goes by kind
of kernel (:func:`step_breakdown`), the CUDA kernels by total time, the GPU time per step, and writes a Chrome trace.

The Trainer paths are profiled inside their own benchmark run, the step the Trainer runs: ``train_throughput.py``
and ``lora_throughput.py`` take ``--profile-steps N`` (the same report as ``profile_<path>.txt`` beside the run's
tables; for LoRA, the baseline's beside ours).

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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gaps import device_intervals, profile_report

# The host ops whose kernels are GEMMs; the shapes of their operands tell whose GEMM it is
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"})
GEMM = "GEMM"
# A kernel's kind by marks in its name, the first match winning (attention before GEMM: a fused attention kernel
# is a GEMM too; copies before element-wise)
KERNEL_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copies", ("memcpy", "memset")),
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("optimizer", ("multi_tensor", "adam")),
    ("loss", ("cross_entropy", "softmax_ce", "nll_loss", "softmax", "logsumexp")),
    (GEMM, ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")),
    ("norms and reductions", ("triton_per", "triton_red", "reduce", "norm")),
    ("element-wise", ("triton_poi", "elementwise", "rope", "swiglu", "fill", "copy", "cat", "index")),
)
ADAPTER_GEMMS, HEAD_GEMMS, BLOCK_GEMMS = "GEMM: adapters", "GEMM: LM head", "GEMM: the rest (decoder blocks)"
# the table's rows, in this order (every kind of KERNEL_MARKS but GEMM, which splits into the first three)
KINDS = (
    BLOCK_GEMMS,
    ADAPTER_GEMMS,
    HEAD_GEMMS,
    "attention",
    "loss",
    "element-wise",
    "norms and reductions",
    "optimizer",
    "copies",
    "communication",
    "other",
)


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name (:data:`KERNEL_MARKS`): ``GEMM``, ``attention``, ``loss``, ..., ``other``."""
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_MARKS if any(mark in lowered for mark in marks)), "other")


def gemm_owner(shapes: Sequence[Any], rank: int | None, vocab: int) -> str:
    """Whose GEMM an op with operands of ``shapes`` runs: the adapters' where a matrix operand has a side of the
    adapters' ``rank``, the LM head's where one has the vocabulary's, else the decoder blocks'."""
    sides = {
        side for shape in shapes if isinstance(shape, (list, tuple)) and len(shape) >= 2 for side in shape
    }
    if rank is not None and rank in sides:
        return ADAPTER_GEMMS
    return HEAD_GEMMS if vocab in sides else BLOCK_GEMMS


def breakdown_table(
    kernels: Iterable[tuple[str, float]],
    gemm_launches: Iterable[tuple[Sequence[Any], str, float]],
    steps: int,
    *,
    rank: int | None,
    vocab: int,
) -> str:
    """Device time per step by kind of kernel, as a markdown table. ``kernels``: every device kernel's ``(name,
    microseconds)``; ``gemm_launches``: the GEMM ops' ``(operand shapes, kernel name, microseconds)``, which split
    the GEMMs into the adapters', the LM head's and the rest."""
    time_us = dict.fromkeys(KINDS, 0.0)
    count = dict.fromkeys(KINDS, 0)
    others: dict[str, float] = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        kind = BLOCK_GEMMS if kind == GEMM else kind
        time_us[kind] += us
        count[kind] += 1
        if kind == "other":
            others[name] = others.get(name, 0.0) + us
    for shapes, name, us in gemm_launches:
        owner = gemm_owner(shapes, rank, vocab)
        if kernel_kind(name) == GEMM and owner != BLOCK_GEMMS:  # moved out of the rest
            time_us[owner] += us
            count[owner] += 1
            time_us[BLOCK_GEMMS] -= us
            count[BLOCK_GEMMS] -= 1
    total = sum(time_us.values())
    if not total:
        return "no device kernels profiled (a CPU run)\n"
    lines = [
        "where the step goes: device time of its kernels by kind; a GEMM is the adapters' where an operand has "
        f"a side of the rank ({rank}), the LM head's where one has the vocabulary's ({vocab})",
        "",
        "| kind | ms/step | share of kernel time | kernels/step |",
        "|---|---:|---:|---:|",
    ]
    for kind in KINDS:
        if count[kind]:
            lines.append(
                f"| {kind} | {time_us[kind] / 1e3 / steps:.2f} | {100 * time_us[kind] / total:.1f} % "
                f"| {count[kind] / steps:.0f} |"
            )
    lines.append(f"| all kernels | {total / 1e3 / steps:.2f} | 100 % | {sum(count.values()) / steps:.0f} |")
    if others:
        top = sorted(others.items(), key=lambda item: -item[1])[:5]
        lines += [
            "",
            "the longest 'other' kernels (ms/step): "
            + "; ".join(f"{name[:70]} {us / 1e3 / steps:.2f}" for name, us in top),
        ]
    return "\n".join(lines) + "\n"


def step_breakdown(profile: Any, steps: int, *, rank: int | None, vocab: int) -> str:
    """:func:`breakdown_table` of a finished ``torch.profiler`` profile (taken with ``record_shapes=True``) over
    ``steps`` steps: the device's kernels, and the kernels each GEMM op launched with its operands' shapes."""
    kernels = [(name, end - start) for start, end, name in device_intervals(profile)]
    launches = [
        (event.input_shapes or [], kernel.name, float(kernel.duration))
        for event in profile.events()
        if event.name in GEMM_OPS
        for kernel in getattr(event, "kernels", None) or []
    ]
    return breakdown_table(kernels, launches, steps, rank=rank, vocab=vocab)


def main() -> None:
    from train_throughput import LORA_PATHS, LORA_RANK, QWEN3_SHAPES, build_model, parse_args

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
    if own.path in LORA_PATHS and own.path != "peft_fsdp_compiled":
        raise SystemExit(
            f"--path {own.path} runs through the Trainer: profile it with benchmarks/lora_throughput.py "
            "--profile-steps 2 (its baseline's profile beside it)"
        )
    shape = ["--model", own.model, "--layers", str(own.layers)]
    args = parse_args([*shape, "--seq-len", str(own.seq_len), "--batch-size", str(own.batch_size)])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model, forward = build_model(own.path, args, device)
    from lightning_d9d.loss import fused_causal_lm_loss
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
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)

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
    with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
        for _ in range(own.steps):
            step()
        torch.cuda.synchronize()
    own.out.mkdir(parents=True, exist_ok=True)
    name = f"{own.model}_{own.path}" + (f"_{own.layers}layers" if own.layers else "")
    name += "_master" if own.master_weights else ""
    profile.export_chrome_trace(str(own.out / f"{name}.json"))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    text = f"{name}: {unprofiled_ms:.1f} ms/step wall (unprofiled), peak {peak:.2f} GiB\n"
    rank = LORA_RANK if own.path in LORA_PATHS else None
    text += step_breakdown(profile, own.steps, rank=rank, vocab=model.config.vocab_size) + "\n"
    text += profile_report(profile, own.steps, own.rows)
    (own.out / f"{name}.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
