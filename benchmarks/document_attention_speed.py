"""Attention alone (forward + backward) on packed rows, one GPU: the candidates for the CUDA path of packed
documents, on the same rows and the Qwen3-0.6B attention shape (16 query heads, 8 key/value heads, head dim 128,
bf16), to pick ``auto``'s choice by measurement.

    causal_nomask   SDPA causal without a document mask (cuDNN): the speed of no mask, wrong across documents
    sdpa_dense      SDPA with the dense [B, 1, T, T] boolean mask (torch's memory-efficient kernel)
    flex            FlexAttention on lightning_d9d's block mask (modules.documents.document_block_mask), compiled
    varlen          torch.nn.attention.varlen.varlen_attn (flash) on cumulative sequence lengths; the lengths are
                    read on the host (nonzero), which a training step would pay once per forward
    flash_attn4_varlen, flash_attn_varlen
                    lightning_d9d's varlen paths (LIGHTNING_D9D_DOCUMENT_ATTENTION=flash_attn4 / flash_attn):
                    FlashAttention 4's / 2's varlen kernel on the rows end to end, q/k/v as the attention block
                    hands them over (transposed views of [B, T, heads, D]); their cu_seqlens are built once per
                    forward in training, so outside the timing: ``varlen_mask_build`` times that build (one host sync)

Rows come from benchmarks/packed_throughput.py's length mix. Run from the repository root on a CUDA GPU:

    PYTHONPATH=. python benchmarks/document_attention_speed.py --out runs/attention
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def time_ms(function: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        function().sum().backward()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function().sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from benchmarks.packed_throughput import make_batches
    from lightning_d9d.modules.attention import document_attention, document_attention_mask
    from lightning_d9d.modules.documents import (
        document_block_mask,
        document_causal_mask,
        document_cu_seqlens,
        document_ids,
    )

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--median-length", type=int, default=600)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.warmup, args.steps, args.seed = 0, 1, 0
    positions = make_batches(args, 1000)["packed"][0]["position_ids"].cuda()
    b, t = positions.shape
    heads, kv_heads, dim = 16, 8, 128
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(h: int) -> torch.Tensor:
        x = torch.randn(b, h, t, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        return x.requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    documents = document_ids(positions)
    block_mask = document_block_mask(documents)
    dense = document_causal_mask(documents)
    flat = positions.flatten()

    def varlen() -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        starts = torch.nonzero(flat == 0).flatten()
        cu = torch.cat([starts, torch.tensor([flat.numel()], device="cuda")]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())  # a host read
        # torch 2.11's varlen_attn takes no enable_gqa (2.13's does): the key/value heads repeated for it
        kr, vr = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        qf, kf, vf = (x.transpose(1, 2).reshape(b * t, heads, dim) for x in (q, kr, vr))
        out = varlen_attn(qf, kf, vf, cu, cu, longest, longest, window_size=(-1, 0))
        return out  # type: ignore[return-value]

    # the block's layout: [B, heads, T, D] views of [B, T, heads, D] (what the varlen paths flatten without a copy)
    qb, kb, vb = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def ours(kernel: str) -> Callable[[], torch.Tensor]:
        documents: list[Any] = []

        def run() -> torch.Tensor:
            if not documents:  # built once (per forward in training), refused here if the kernel cannot run
                documents.append(document_attention_mask(positions, kernel))
            return document_attention(qb, kb, vb, documents[0])

        return run

    def mask_build() -> torch.Tensor:
        cu_seqlens, _ = document_cu_seqlens(positions)
        return cu_seqlens.float().requires_grad_()  # time_ms sums and backpropagates what it is given

    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "causal_nomask": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa_dense": lambda: document_attention(q, k, v, dense),
        "flex": lambda: document_attention(q, k, v, block_mask),
        "varlen": varlen,
        "flash_attn4_varlen": ours("flash_attn4"),
        "flash_attn_varlen": ours("flash_attn"),
        "varlen_mask_build": mask_build,
    }
    with torch.no_grad():
        reference = document_attention(q, k, v, dense).float()
    results: dict[str, dict[str, float | str]] = {}
    for name, function in candidates.items():
        try:
            with torch.no_grad():
                out = function()
            if name == "varlen":
                out = out.reshape(b, t, heads, dim).transpose(1, 2)
            exact = name not in ("causal_nomask", "varlen_mask_build")
            error = float((out.float() - reference).abs().max()) if exact else float("nan")
            ms = time_ms(function, args.repeats)
            results[name] = {"fwd_bwd_ms": ms, "max_abs_diff_vs_sdpa_dense": error}
            print(f"{name:14s} {ms:8.2f} ms fwd+bwd   max |diff| vs dense-mask SDPA {error:.2e}", flush=True)
        except Exception as failure:  # a candidate this torch cannot run: say so and go on
            results[name] = {"error": f"{type(failure).__name__}: {failure}"[:400]}
            print(f"{name:14s} failed: {results[name]['error']}", flush=True)
    sparsity = float(dense.float().mean())
    print(f"mask density (attending pairs / T^2): {sparsity:.4f}; block mask: {block_mask}".splitlines()[0])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "shape": [b, t],
            "results": results,
        }
        (args.out / "document_attention_speed.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
