"""Kernel benchmark on one CUDA GPU: ours against torch eager, ``torch.compile`` of the reference, and the
libraries that have the same kernel (``liger-kernel``, ``cut-cross-entropy``) where they import.

    python benchmarks/kernel_speed.py [--out results.json] [--quick]

Per kernel and shape: forward and forward+backward time, achieved GB/s (the bytes a fused kernel must move,
counted once) against the copy bandwidth measured in the same run; the fused LM-head cross-entropy's peak
memory against logits + cross-entropy at vocab 151,936; and the attention table: SDPA's backends (and
``flash-attn`` through our ``flash_attn`` backend, if installed, and what the registry picks) at seq
2048/4096/8192, head dim 128, GQA 16/8, forward+backward TFLOP/s, and on the attention block's layout the
``sdpa_cudnn``, ``flash_attn4`` (FlashAttention 4) and ``flash_attn`` backends side by side; the grouped GEMM
backends (``torch``, ``triton``, the ``grouped_gemm`` package if installed, ``loop``, and ``torchao_fp8``, float8
rowwise through torchao, where it runs: compute capability 9.0+ with torchao installed) at the MoE shapes.
Everything is bf16. Results go to docs/benchmarks.md by hand (with the GPU, versions and date printed here).
"""

# Each loop iteration builds closures over its own inputs and runs them before the next iteration: B023 is moot.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import itertools
import json
import math
import platform
import time
import traceback
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F

from lightning_d9d.kernels.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lightning_d9d.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from lightning_d9d.kernels.rope import rope_reference, rope_triton
from lightning_d9d.kernels.swiglu import swiglu_reference, swiglu_triton

DTYPE = torch.bfloat16
Run = Callable[[], Any]


def timed(fn: Run, iters: int = 20, warmup: int = 3) -> float:
    """Mean GPU milliseconds per call over ``iters`` calls after ``warmup``.

    A long sleep kernel is queued first, so the host has enqueued the calls before the GPU reaches them and the
    events time the GPU's work alone, as in a training step where the host runs ahead (without it, kernels of
    tens of microseconds would time Python's launch overhead). A call that synchronises still pays for it.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def copy_bandwidth() -> float:
    """GB/s of ``dst.copy_(src)`` on 1 GiB (read + write counted)."""
    src = torch.empty(2**29, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), iters=30)
    return 2 * src.numel() * src.element_size() / ms / 1e6


@cache
def copy_ms(moved_bytes: int) -> float:
    """GPU milliseconds of one ``copy_`` that reads and writes ``moved_bytes`` in total: the ceiling for a
    kernel of that size, whose launch ramp and tail weigh more than in the 1 GiB copy of ``copy_bandwidth``."""
    src = torch.empty(max(1, moved_bytes // 4), dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), iters=50)


def _library(module: str, name: str) -> Callable[..., Any] | None:
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except Exception:  # not installed, or not importable with this torch/triton: left out of the table
        return None


def fwd_bwd(forward: Callable[[], Any], inputs: list[torch.Tensor]) -> tuple[Run, Run]:
    """(forward only, forward + backward against fixed random incoming gradients)."""
    outs = forward()
    outs = outs if isinstance(outs, tuple) else (outs,)
    incoming = [torch.randn_like(o) for o in outs]

    def fb() -> None:
        result = forward()
        result = result if isinstance(result, tuple) else (result,)
        torch.autograd.backward(result, incoming)
        for t in inputs:
            t.grad = None

    def f() -> None:
        with torch.no_grad():
            forward()

    return f, fb


def _rms_norm_launch(
    x: torch.Tensor, w: torch.Tensor, tile: int, per_sm: int, stages: int
) -> Callable[[], Any]:
    """Our RMSNorm with another launch shape (``rmsnorm.TILE_ELEMENTS`` / ``PROGRAMS_PER_SM`` /
    ``BACKWARD_STAGES``). Set, not restored, by each call: the backward reads them after the forward returns;
    ``elementwise_rows`` puts the defaults back."""
    from lightning_d9d.kernels import rmsnorm

    def run() -> Any:
        rmsnorm.TILE_ELEMENTS, rmsnorm.PROGRAMS_PER_SM, rmsnorm.BACKWARD_STAGES = tile, per_sm, stages
        return rms_norm_triton(x, w, 1e-6)

    return run


def elementwise_rows(copy_gbs: float, quick: bool) -> list[dict[str, Any]]:
    from lightning_d9d.kernels import rmsnorm

    rows: list[dict[str, Any]] = []
    liger_rms = _library("liger_kernel.transformers.functional", "liger_rms_norm")
    liger_swiglu = _library("liger_kernel.transformers.functional", "liger_swiglu")
    liger_rope = _library("liger_kernel.transformers.functional", "liger_rope")
    compiled_rms = torch.compile(rms_norm_reference)
    compiled_swiglu = torch.compile(swiglu_reference)
    compiled_rope = torch.compile(rope_reference)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=DTYPE).requires_grad_()

    # 4 x 4096 x 4096: a wider model's hidden size, where the launch and reduction overheads weigh less
    norm_shapes = [(4, 4096, 1024), (4, 4096, 16, 128), (4, 4096, 4096)] if not quick else [(4, 4096, 1024)]
    for shape in norm_shapes:
        x, w = leaf(*shape), leaf(shape[-1])
        variants: dict[str, Callable[[], Any]] = {
            "ours (Triton)": lambda: rms_norm_triton(x, w, 1e-6),
            "torch eager": lambda: rms_norm_reference(x, w, 1e-6),
            "torch.compile": lambda: compiled_rms(x, w, 1e-6),
        }
        if liger_rms is not None:
            variants["liger"] = lambda: liger_rms(x, w, 1e-6)  # type: ignore[misc]
        if not quick:  # our launch shapes (tile elements, backward programs per SM, pipeline stages)
            for tile, per_sm, stages in itertools.product((2048, 4096, 8192), (2, 4, 8), (1, 2, 3)):
                name = f"ours, tile {tile}, {per_sm}/SM, {stages} stages"
                variants[name] = _rms_norm_launch(x, w, tile, per_sm, stages)
        defaults = rmsnorm.TILE_ELEMENTS, rmsnorm.PROGRAMS_PER_SM, rmsnorm.BACKWARD_STAGES
        rows += measure("rms_norm", shape, variants, [x, w], x.numel() * 2 * 2, x.numel() * 2 * 3, copy_gbs)
        rmsnorm.TILE_ELEMENTS, rmsnorm.PROGRAMS_PER_SM, rmsnorm.BACKWARD_STAGES = defaults
    for shape in [(4, 4096, 3072)]:
        g, u = leaf(*shape), leaf(*shape)
        variants = {
            "ours (Triton)": lambda: swiglu_triton(g, u),
            "torch eager": lambda: swiglu_reference(g, u),
            "torch.compile": lambda: compiled_swiglu(g, u),
        }
        if liger_swiglu is not None:
            variants["liger"] = lambda: liger_swiglu(g, u)  # type: ignore[misc]
        rows += measure("swiglu", shape, variants, [g, u], g.numel() * 2 * 3, g.numel() * 2 * 5, copy_gbs)
    for batch, seq in [(4, 4096)]:
        q = torch.randn(batch, seq, 16, 128, device="cuda", dtype=DTYPE).transpose(1, 2).requires_grad_()
        k = torch.randn(batch, seq, 8, 128, device="cuda", dtype=DTYPE).transpose(1, 2).requires_grad_()
        angles = torch.rand(1, seq, 64, device="cuda") * 1000
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
        variants = {
            "ours (Triton)": lambda: rope_triton(q, k, cos, sin),
            "torch eager": lambda: rope_reference(q, k, cos, sin),
            "torch.compile": lambda: compiled_rope(q, k, cos, sin),
        }
        if liger_rope is not None:
            variants["liger"] = lambda: liger_rope(q, k, cos, sin)  # type: ignore[misc]
        moved = (q.numel() + k.numel()) * 2 * 2
        rows += measure("rope q+k", (batch, seq, "16/8 heads", 128), variants, [q, k], moved, moved, copy_gbs)
    return rows


def flops_row(
    kernel: str,
    shape: str,
    impl: str,
    forward: Callable[[], Any],
    inputs: list[torch.Tensor],
    fwd_flops: float,
    fwd_bwd_flops: float,
    iters: int = 20,
) -> dict[str, Any]:
    """One compute-bound variant: forward and forward + backward times and their TFLOP/s, printed."""
    row: dict[str, Any] = {"kernel": kernel, "shape": shape, "impl": impl}
    try:
        f, fb = fwd_bwd(forward, inputs)
        row["fwd_ms"], row["fwd_bwd_ms"] = timed(f, iters=iters), timed(fb, iters=iters)
        row["fwd_TFLOPs"] = fwd_flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_TFLOPs"] = fwd_bwd_flops / row["fwd_bwd_ms"] / 1e9
    except Exception as error:  # a backend or library that does not run here: recorded, not fatal
        row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    print(json.dumps(row), flush=True)
    return row


def measure(
    kernel: str,
    shape: tuple[Any, ...],
    variants: dict[str, Callable[[], Any]],
    inputs: list[torch.Tensor],
    fwd_bytes: int,
    bwd_bytes: int,
    copy_gbs: float,
) -> list[dict[str, Any]]:
    rows = []
    for name, forward in variants.items():
        row: dict[str, Any] = {"kernel": kernel, "shape": str(shape), "impl": name}
        try:
            f, fb = fwd_bwd(forward, inputs)
            row["fwd_ms"] = timed(f)
            row["fwd_bwd_ms"] = timed(fb)
            row["fwd_GBs"] = fwd_bytes / row["fwd_ms"] / 1e6
            bwd_ms = row["fwd_bwd_ms"] - row["fwd_ms"]
            row["bwd_GBs"] = bwd_bytes / bwd_ms / 1e6 if bwd_ms > 0 else math.nan
            row["fwd_bwd_GBs"] = (fwd_bytes + bwd_bytes) / row["fwd_bwd_ms"] / 1e6
            row["fwd_bwd_pct_copy"] = 100 * row["fwd_bwd_GBs"] / copy_gbs
            # against one copy of the same bytes (a fwd + bwd is several launches, each with its ramp and tail)
            row["fwd_bwd_pct_same_size_copy"] = 100 * copy_ms(fwd_bytes + bwd_bytes) / row["fwd_bwd_ms"]
        except Exception as error:  # a library that does not run here: recorded, not fatal
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cross_entropy_rows(quick: bool) -> list[dict[str, Any]]:
    tokens, hidden, vocab = 16384, 1024, 151936
    h = (torch.randn(tokens, hidden, device="cuda") * 1.0).to(DTYPE).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(DTYPE).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::10] = -100
    compiled = torch.compile(linear_cross_entropy_reference)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "ours (chunked)": lambda: chunked_linear_cross_entropy(h, w, labels),
        **{  # the chunk length: fewer, larger matmuls against a larger peak
            f"ours, {chunk}-token chunks": lambda chunk=chunk: chunked_linear_cross_entropy(
                h, w, labels, chunk_tokens=chunk
            )
            for chunk in ((1024, 2048, 4096, 8192) if not quick else ())
        },
        "logits + CE (eager)": lambda: linear_cross_entropy_reference(h, w, labels),
        "logits + CE (torch.compile)": lambda: compiled(h, w, labels),
    }
    liger = _library("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
    if liger is not None:

        def run_liger() -> torch.Tensor:
            out = liger(h, w, labels)  # type: ignore[misc]
            return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

        variants["liger"] = run_liger
    cce = _library("cut_cross_entropy", "linear_cross_entropy")
    if cce is not None:
        variants["cut-cross-entropy (its default: gradient filter)"] = lambda: cce(h, w, labels)  # type: ignore[misc]
        variants["cut-cross-entropy (exact: filter_eps=None)"] = lambda: cce(h, w, labels, filter_eps=None)  # type: ignore[misc]
    rows = []
    for name, forward in variants.items():
        row: dict[str, Any] = {
            "kernel": "linear+CE",
            "shape": f"{tokens}x{hidden}, vocab {vocab}",
            "impl": name,
        }
        try:

            def step() -> None:
                forward().backward()
                h.grad = w.grad = None

            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            row["fwd_bwd_ms"] = timed(step, iters=5 if quick else 10, warmup=1)
            ref = linear_cross_entropy_reference(h, w, labels).item()
            row["loss_rel_err"] = abs(forward().item() - ref) / abs(ref)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            traceback.print_exc()
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def attention_rows(quick: bool) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_d9d.modules.attention import select_attention_backend

    heads, kv_heads, head_dim, tokens = 16, 8, 128, 16384
    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    flash_attn = _library("flash_attn", "flash_attn_func")
    rows = []
    for seq in [2048, 4096] if quick else [2048, 4096, 8192]:
        batch = tokens // seq
        q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=DTYPE).requires_grad_()
        k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=DTYPE).requires_grad_()
        v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=DTYPE).requires_grad_()
        flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half of the score matrix
        variants: dict[str, Callable[[], torch.Tensor]] = {}
        if flash_attn is not None:
            variants["flash-attn (backend flash_attn)"] = partial(
                select_attention_backend(q, "flash_attn").run, q, k, v
            )
        for name, backend in backends.items():
            if name == "math" and seq > 2048:
                continue  # materialises [B, H, T, T] in fp32: minutes, and known to be slowest

            def native(backend: SDPBackend = backend) -> torch.Tensor:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def repeated(backend: SDPBackend = backend) -> torch.Tensor:
                groups = heads // kv_heads
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(
                        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
                    )

            variants[f"sdpa {name} (gqa)"] = native
            variants[f"sdpa {name} (repeat kv)"] = repeated
        variants["sdpa default (gqa)"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        chosen = select_attention_backend(q)
        variants[f"registry auto ({chosen.name})"] = partial(chosen.run, q, k, v)
        shape = f"B{batch} T{seq} H16/8 D128"
        for name, forward in variants.items():
            rows.append(flops_row("attention", shape, name, forward, [q, k, v], flops, 3.5 * flops, iters=10))
        # The attention block's layout: [B, heads, T, D] views of [B, T, heads, D], which the flash kernels take
        # without a copy (the rows above hand them contiguous [B, heads, T, D], which they would copy first);
        # cuDNN beside them on the same inputs: the pair that auto's choice of attention backend rests on.
        qb, kb, vb = (
            x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)
        )
        for backend in ("sdpa_cudnn", "flash_attn4", "flash_attn"):
            try:
                run = select_attention_backend(qb, backend).run
            except ValueError as refusal:  # not installed, or not this GPU: said once per shape
                print(
                    json.dumps(
                        {"kernel": "attention", "shape": shape, "impl": backend, "skipped": str(refusal)}
                    )
                )
                continue
            name = f"backend {backend} (block layout)"
            rows.append(
                flops_row(
                    "attention",
                    shape,
                    name,
                    partial(run, qb, kb, vb),
                    [qb, kb, vb],
                    flops,
                    3.5 * flops,
                    iters=10,
                )
            )
    return rows


def projection_rows() -> list[dict[str, Any]]:
    """A decoder layer's input projections at the 0.6B shape (16384 tokens, hidden 1024), forward + backward:
    separate GEMMs as the checkpoint's layout has them (q, k, v; gate, up) against one GEMM over their
    concatenated weights (concatenated per call, as a model keeping the checkpoint's parameters would, or
    stored as one parameter), eager and under ``torch.compile``; TFLOP/s of the GEMMs' FLOPs."""
    tokens, hidden = 16384, 1024
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE).requires_grad_()
    rows = []
    for label, outs in {"q,k,v": (2048, 1024, 1024), "gate,up": (3072, 3072)}.items():
        ws = [(torch.randn(n, hidden, device="cuda") * 0.02).to(DTYPE).requires_grad_() for n in outs]
        one = (torch.randn(sum(outs), hidden, device="cuda") * 0.02).to(DTYPE).requires_grad_()

        def separate() -> tuple[torch.Tensor, ...]:
            return tuple(F.linear(x, w) for w in ws)

        def concatenated() -> tuple[torch.Tensor, ...]:
            return F.linear(x, torch.cat(ws)).split(outs, dim=-1)

        def one_weight() -> tuple[torch.Tensor, ...]:
            return F.linear(x, one).split(outs, dim=-1)

        variants = {
            "separate": separate,
            "concatenated per call": concatenated,
            "one parameter": one_weight,
            "separate, torch.compile": torch.compile(separate),
            "concatenated per call, torch.compile": torch.compile(concatenated),
        }
        flops = 2 * tokens * hidden * sum(outs)
        shape = f"{tokens}x{hidden} -> {outs}"
        for name, forward in variants.items():
            rows.append(
                flops_row(f"projections {label}", shape, name, forward, [x, *ws, one], flops, 3 * flops)
            )
    return rows


def moe_rows(copy_gbs: float) -> list[dict[str, Any]]:
    """MoE token permutation (round trip through a per-expert scaling) and the grouped GEMM backends, at a
    Qwen3-MoE-like shape: 16384 tokens, hidden 1024, top-8 of 128 experts, expert width 768."""
    import os

    from lightning_d9d.kernels import permute_tokens, unpermute_tokens, weigh_rows, weights_by_row

    tokens, hidden, top_k, experts = 16384, 1024, 8, 128
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE).requires_grad_()
    indices = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device="cuda").requires_grad_()
    scale = torch.randn(experts, hidden, device="cuda", dtype=DTYPE)

    def round_trip() -> torch.Tensor:
        grouped, permutation = permute_tokens(x, indices)
        return unpermute_tokens(grouped * scale[indices.reshape(-1)[permutation.order]], permutation, weights)

    def round_trip_rows_weighed() -> torch.Tensor:
        """The MoE block's way: each row weighed by the "expert" (fused into its scaling), an unweighted sum back."""
        grouped, permutation = permute_tokens(x, indices)
        expert_rows = grouped * scale[indices.reshape(-1)[permutation.order]]
        return unpermute_tokens(weigh_rows(expert_rows, weights_by_row(weights, permutation)), permutation)

    def with_kernels(mode: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            os.environ["LIGHTNING_D9D_KERNELS"] = mode
            try:
                return fn()
            finally:
                os.environ.pop("LIGHTNING_D9D_KERNELS", None)

        return run

    def compiled(mode: str, fn: Callable[[], torch.Tensor] = round_trip) -> Callable[[], torch.Tensor]:
        """``round_trip`` compiled afresh under ``mode`` (Dynamo does not guard on the environment: each
        variant starts from an empty cache), as a compiled MoE block runs it: our kernels are custom operators
        there, the sort and index bookkeeping fused by Inductor."""
        state: dict[str, Any] = {}

        def run() -> torch.Tensor:
            if "fn" not in state:
                torch._dynamo.reset()
                state["fn"] = torch.compile(fn)
            return with_kernels(mode, state["fn"])()

        return run

    # bytes a fused round trip must move: x read, k rows written and read back (twice with the scaling), out
    moved = (tokens * hidden + 3 * tokens * top_k * hidden + tokens * hidden) * 2
    rows = measure(
        "moe permute+unpermute",
        (tokens, hidden, f"top-{top_k} of {experts}"),
        {
            "ours (Triton), eager": with_kernels("triton", round_trip),
            "ours in torch.compile": compiled("triton"),
            "ours in torch.compile, rows weighed before the sum": compiled("triton", round_trip_rows_weighed),
            "torch eager": with_kernels("reference", round_trip),
            "torch.compile": compiled("reference"),
        },
        [x, weights],
        moved,
        moved,
        copy_gbs,
    )
    return rows + grouped_gemm_rows(GEMM_SHAPES[:1])


# (experts, K, N): Qwen3-MoE-like (128 experts of width 768, the up projection), and the MoE benchmark's model
# (64 experts of width 384: gate+up 1024 -> 768, down 384 -> 1024); 16384 tokens, top-8.
GEMM_SHAPES = [(128, 1024, 768), (64, 1024, 768), (64, 384, 1024)]


def grouped_gemm_rows(
    shapes: list[tuple[int, int, int]], tokens: int = 16384, top_k: int = 8
) -> list[dict[str, Any]]:
    """The grouped GEMM backends (and what ``auto`` picks) on uniformly routed tokens, forward and forward +
    backward. ``grouped_gemm`` is the package's backend (group sizes copied to the host, as it needs); "device
    sizes" is the package called directly with the sizes on the GPU (its CUTLASS build's path, no sync);
    ``torchao_fp8`` the float8 rowwise backend (groups padded to 16 rows, the weight copied column-major, both
    inside the timing, as the experts run it; its TFLOP/s count the bf16 product's flops), where it runs."""
    from lightning_d9d.kernels import grouped_mm
    from lightning_d9d.kernels.grouped_gemm import select_grouped_gemm_backend
    from lightning_d9d.kernels.grouped_gemm_fp8 import FLOAT8_BACKEND, fp8_grouped_gemm_unsupported

    package = _library("grouped_gemm.ops", "gmm")
    rows = []
    for experts, k, n in shapes:
        indices = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
        sizes = torch.bincount(indices.reshape(-1), minlength=experts)
        a = torch.randn(tokens * top_k, k, device="cuda", dtype=DTYPE).requires_grad_()
        w = (torch.randn(experts, k, n, device="cuda") * 0.03).to(DTYPE).requires_grad_()
        flops = 2 * tokens * top_k * k * n
        shape = f"{tokens * top_k}x{k} @ {experts}x{k}x{n}"
        variants: dict[str, Callable[[], torch.Tensor]] = {
            backend: partial(grouped_mm, a, w, sizes, backend=backend)
            for backend in ("torch", "triton", "grouped_gemm", "loop")
        }
        variants[f"auto ({select_grouped_gemm_backend(a, w).name})"] = partial(grouped_mm, a, w, sizes)
        if fp8_grouped_gemm_unsupported(a, w) is None:
            variants[f"{FLOAT8_BACKEND} (float8 rowwise)"] = partial(
                grouped_mm, a, w, sizes, backend=FLOAT8_BACKEND
            )
        if package is not None:
            variants["grouped_gemm, device sizes"] = partial(
                package, a, w, sizes.to(torch.int64), trans_b=False
            )
        for name, forward in variants.items():
            rows.append(flops_row("grouped GEMM", shape, name, forward, [a, w], flops, 3 * flops, iters=10))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write all rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument(
        "--only",
        default="elementwise,ce,attention,projections,moe",
        help="comma-separated parts to run (also: grouped_gemm, the GEMM backends at every MoE shape)",
    )
    args = parser.parse_args()
    started = time.time()
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    for lib in ("liger_kernel", "cut_cross_entropy", "flash_attn", "grouped_gemm"):
        try:
            module = importlib.import_module(lib)
            env[lib] = getattr(module, "__version__", "installed")
        except Exception as error:
            env[lib] = f"not available ({type(error).__name__})"
    # FA4's flash_attn is a namespace package (no __version__): its distribution says which one ran
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = "not installed"
    print(json.dumps(env), flush=True)
    parts = set(args.only.split(","))
    copy_gbs = copy_bandwidth()
    print(json.dumps({"copy_GBs": copy_gbs}), flush=True)
    rows: list[dict[str, Any]] = []
    if "elementwise" in parts:
        rows += elementwise_rows(copy_gbs, args.quick)
    if "ce" in parts:
        rows += cross_entropy_rows(args.quick)
    if "attention" in parts:
        rows += attention_rows(args.quick)
    if "projections" in parts:
        rows += projection_rows()
    if "grouped_gemm" in parts:  # the GEMMs alone, every shape (moe runs the first with the permutation)
        rows += grouped_gemm_rows(GEMM_SHAPES)
    if "moe" in parts:
        try:
            rows += moe_rows(copy_gbs)
        except Exception:  # the MoE rows need the most: a failure here must not lose the rows above
            traceback.print_exc()
    result = {"env": env, "copy_GBs": copy_gbs, "rows": rows, "seconds": time.time() - started}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    print(f"done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
