"""Useful tokens per second of packed rows against padded ones, and of the attention paths for packed rows, on one
GPU, in one run (docs/benchmarks.md's packed-documents table, run G7).

Every path trains our Qwen3 (``--model 0.6b``: the Qwen3-0.6B shape) with per-block ``torch.compile`` (the product's
compile), bf16 autocast over fp32 master weights, fused AdamW, and the LM head fused with the loss, on documents
drawn from one length mix (below). Paths, each on a fresh model from the same seed:

    padded        one document per row, cut to ``--seq-len`` and padded (labels -100): plain causal attention
                  (cuDNN), what a user without packing trains
    packed_flex   the documents packed into rows (``lightning_d9d.data.pack_documents``), attention inside each
                  document through FlexAttention's block mask (``LIGHTNING_D9D_DOCUMENT_ATTENTION=flex``)
    packed_sdpa   the same rows through SDPA with the dense ``[B, 1, T, T]`` mask (``=sdpa``)
    packed_nomask the same rows attended across documents (no position_ids): wrong for training, here only as the
                  speed of attention with no mask at all (cuDNN causal), the ceiling of the masked paths
    packed_flash_attn4, packed_flash_attn
                  the same rows through FlashAttention 4's / 2's varlen kernel on the rows end to end
                  (``=flash_attn4`` / ``=flash_attn``; not in the default list: each needs its package, carried or
                  built for a GPU host without a network, benchmarks/README.md)

Useful tokens are the labels that are not -100 (a padded row's padding is not useful). The masked packed paths
train on the same batches: their losses must agree with ``packed_sdpa``'s (else ``packed_flex``'s; the loss guard,
2 %); ``padded`` sees the same documents in another grouping, so its loss is reported, not compared.

The length mix: log-normal document lengths (median ``--median-length`` tokens, sigma ``--sigma``), at least 16
tokens, at most 16 x the row (a long tail cut into row-long pieces by the packer) — web text in the large is of
this shape (most documents a few hundred tokens, a heavy tail of long ones). The mix's own numbers (mean, the share
of tokens in documents longer than a row) are printed and written with the results.

Run on a CUDA GPU from the repository root:

    PYTHONPATH=. python benchmarks/packed_throughput.py --out runs/packed
    PYTHONPATH=. python benchmarks/packed_throughput.py --device cpu --model tiny --seq-len 128 --batch-size 2 \
        --warmup 1 --steps 2 --paths padded,packed_sdpa                                   # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

PATHS = ("padded", "packed_flex", "packed_sdpa", "packed_nomask")
# the varlen kernels' paths: by name (each needs an optional package), with the attention path each forces
VARLEN_PATHS = {"packed_flash_attn4": "flash_attn4", "packed_flash_attn": "flash_attn"}
MASKED = ("packed_flex", "packed_sdpa", *VARLEN_PATHS)


def document_lengths(args: argparse.Namespace, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(args.seed)
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    lengths = (math.log(args.median_length) + args.sigma * normal).exp().round().long()
    return lengths.clamp(16, 16 * args.seq_len).tolist()


def make_batches(args: argparse.Namespace, vocab: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per path family, the batches of every step: ``padded`` rows of one document each, ``packed`` rows of many;
    both from the same documents, in the same order (each family as many steps as asked)."""
    from lightning_d9d.data import pack_documents

    steps = args.warmup + args.steps
    rows_needed = steps * args.batch_size
    generator = torch.Generator().manual_seed(args.seed + 1)
    lengths = document_lengths(
        args, 4 * rows_needed * max(1, args.seq_len // args.median_length) + rows_needed
    )
    documents = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    padded_rows = []
    for document in documents[:rows_needed]:
        inputs, labels = document[: args.seq_len][:-1], document[: args.seq_len][1:]
        pad = args.seq_len - inputs.numel()
        padded_rows.append(
            {
                "input_ids": torch.cat([inputs, torch.zeros(pad, dtype=torch.long)]),
                "labels": torch.cat([labels, torch.full((pad,), -100)]),
            }
        )
    packed_rows = []
    for row in pack_documents(documents, args.seq_len):
        packed_rows.append(row)
        if len(packed_rows) == rows_needed:
            break
    if len(packed_rows) < rows_needed:
        raise SystemExit(f"the documents filled {len(packed_rows)} packed rows, {rows_needed} needed")

    def batched(rows: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return [
            torch.utils.data.default_collate(rows[i : i + args.batch_size])
            for i in range(0, rows_needed, args.batch_size)
        ]

    return {"padded": batched(padded_rows), "packed": batched(packed_rows)}


def mix_summary(args: argparse.Namespace) -> dict[str, float]:
    lengths = torch.tensor(document_lengths(args, 100_000), dtype=torch.float64)
    return {
        "median_tokens": float(lengths.median()),
        "mean_tokens": float(lengths.mean()),
        "share_of_tokens_in_documents_longer_than_a_row": float(
            lengths[lengths > args.seq_len].sum() / lengths.sum()
        ),
        "share_of_documents_longer_than_a_row": float((lengths > args.seq_len).double().mean()),
    }


def run_path(path: str, args: argparse.Namespace, batches: dict[str, list[dict[str, torch.Tensor]]]) -> dict:
    from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
    from lightning_d9d.plans import apply_compile

    device = torch.device(args.device)
    os.environ["LIGHTNING_D9D_DOCUMENT_ATTENTION"] = "sdpa" if path == "packed_sdpa" else "auto"
    if path == "packed_flex" and device.type == "cuda":
        os.environ["LIGHTNING_D9D_DOCUMENT_ATTENTION"] = "flex"
    if path in VARLEN_PATHS:
        os.environ["LIGHTNING_D9D_DOCUMENT_ATTENTION"] = VARLEN_PATHS[path]
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = Qwen3Config.qwen3_0_6b() if args.model == "0.6b" else Qwen3Config.tiny()
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    if args.compile:
        apply_compile(model.model.layers)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    family = batches["padded" if path == "padded" else "packed"]
    on_device = [{k: v.to(device, non_blocking=True) for k, v in batch.items()} for batch in family]
    useful = [int((batch["labels"] != -100).sum()) for batch in family]

    def step(i: int) -> torch.Tensor:
        batch = on_device[i]
        positions = batch["position_ids"] if path in MASKED else None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.forward_loss(batch["input_ids"], batch["labels"], positions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    t0 = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(i))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - t0
    timings: list[Any] = []
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(i))
            end.record()
            timings.append((start, end))
        else:
            t = time.perf_counter()
            losses.append(step(i))
            timings.append(time.perf_counter() - t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    window_s = time.perf_counter() - t0
    if device.type == "cuda":
        step_ms = [start.elapsed_time(end) for start, end in timings]
    else:
        step_ms = [1000 * seconds for seconds in timings]
    measured_useful = sum(useful[args.warmup :])
    median_ms = statistics.median(step_ms)
    mean_useful = measured_useful / args.steps
    result = {
        "path": path,
        "useful_tokens_per_s_window": measured_useful / window_s,
        "useful_tokens_per_s_median_step": mean_useful / (median_ms / 1000),
        "median_step_ms": median_ms,
        "step_ms": step_ms,
        "useful_share": measured_useful / (args.steps * args.batch_size * args.seq_len),
        "warmup_s": warmup_s,
        "final_loss": float(torch.stack(losses[-5:]).float().mean()),
        "losses": [float(x) for x in losses],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    return result


def versions() -> dict[str, Any]:
    import lightning
    import triton

    info = {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="0.6b", choices=["0.6b", "tiny"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--median-length", type=int, default=600)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lightning_d9d.models import Qwen3Config

    vocab = (Qwen3Config.qwen3_0_6b() if args.model == "0.6b" else Qwen3Config.tiny()).vocab_size
    batches = make_batches(args, vocab)
    mix = mix_summary(args)
    print("length mix:", json.dumps(mix))
    results = []
    for path in args.paths.split(","):
        if path not in PATHS and path not in VARLEN_PATHS:
            raise SystemExit(f"unknown path {path!r}: choose from {', '.join([*PATHS, *VARLEN_PATHS])}")
        result = run_path(path, args, batches)
        results.append(result)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the path's model and optimizer are gone with run_path's frame
        print(
            f"{path:14s} useful tokens/s {result['useful_tokens_per_s_median_step']:>10.0f} (median step "
            f"{result['median_step_ms']:.1f} ms, useful share {result['useful_share']:.2f}) window "
            f"{result['useful_tokens_per_s_window']:.0f}/s  loss {result['final_loss']:.4f}  peak "
            f"{result['peak_mem_gib'] or 0:.1f} GiB",
            flush=True,
        )
    by_path = {r["path"]: r for r in results}
    guard = None
    reference = next((p for p in ("packed_sdpa", "packed_flex") if p in by_path), None)
    for other in (p for p in MASKED if p in by_path and p != reference):
        assert reference is not None
        a, b = by_path[other]["final_loss"], by_path[reference]["final_loss"]
        apart = abs(a - b) / b
        guard = apart if guard is None else max(guard, apart)
        print(f"loss guard: {other} vs {reference} final loss differ by {100 * apart:.2f} % (limit 2 %)")
    if "padded" in by_path:
        base = by_path["padded"]["useful_tokens_per_s_median_step"]
        for r in results:
            print(f"{r['path']:14s} {r['useful_tokens_per_s_median_step'] / base:.2f}x padded")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "versions": versions(),
        "length_mix": mix,
        "loss_guard_relative": guard,
        "results": results,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packed_throughput.json").write_text(json.dumps(record, indent=1))
    if guard is not None and guard > 0.02:
        raise SystemExit("loss guard failed: the masked packed paths trained apart")


if __name__ == "__main__":
    main()
