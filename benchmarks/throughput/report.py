"""What the parent makes of the workers' results: tokens/s, model TFLOP/s and MFU from each path's measured window
(``derive``), the ratios to the baselines, the loss guard (``check_losses``), the Markdown tables (``markdown``),
and what a run measured (``run_meta``: shape, steps, recipe, software versions, command)."""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from .paths import BASELINES, RATIO_COLUMNS
from .shapes import MODEL_NAMES, _config


def derive(results: list[dict[str, Any]], args: argparse.Namespace, fpt: int) -> None:
    tokens_per_step = args.batch_size * args.seq_len
    for r in results:
        if r.get("ok") and r.get("elapsed_s"):
            r["tokens_per_s"] = tokens_per_step * args.steps / r["elapsed_s"]
            r["model_tflops"] = fpt * r["tokens_per_s"] / 1e12
            r["mfu"] = r["model_tflops"] / args.peak_tflops
    base = {}
    for name in BASELINES:  # the first run of each baseline (a repeat, if any, measures the spread)
        first = next((r for r in results if r["path"] == name and r.get("tokens_per_s")), None)
        if first is not None:
            base[name] = first
    for r in results:
        for name, baseline in base.items():
            if r.get("tokens_per_s"):
                r[f"vs_{name}"] = r["tokens_per_s"] / baseline["tokens_per_s"]  # mean tokens/s
            if _median(r, "step_ms") and _median(baseline, "step_ms"):
                r[f"median_vs_{name}"] = _median(baseline, "step_ms") / _median(r, "step_ms")
    check_losses(results)


def _median(result: dict[str, Any], key: str) -> Any:
    """The median of a per-step summary (``_summary``), None where the path recorded none."""
    return (result.get(key) or {}).get("median")


LOSS_TOLERANCE = 0.02


def check_losses(results: list[dict[str, Any]]) -> None:
    """The correctness guard: every path trains on the same batch with the same optimizer and learning rate, so
    its loss after the last step must be finite and within ``LOSS_TOLERANCE`` (relative) of the baseline's (the
    first baseline path that ran). Sets ``final_loss``, ``loss_vs_baseline`` and ``loss_ok`` on each result."""
    trained = [r for r in results if r.get("ok") and r.get("losses")]
    baseline = next((r for name in BASELINES for r in trained if r["path"] == name), None)
    for r in trained:
        final = r["losses"][-1]
        r["final_loss"] = final
        if baseline is None:
            r["loss_ok"] = math.isfinite(final)
            continue
        relative = final / baseline["losses"][-1] - 1
        r["loss_vs_baseline"] = relative
        r["loss_ok"] = math.isfinite(final) and abs(relative) <= LOSS_TOLERANCE


def _label(r: dict[str, Any], results: list[dict[str, Any]]) -> str:
    earlier = [x for x in results if x["path"] == r["path"] and x["job"] < r["job"]]
    return f"{r['path']} (repeat {len(earlier)})" if earlier else r["path"]


def markdown(
    results: list[dict[str, Any]], meta: dict[str, Any], ratios: tuple[str, ...] = RATIO_COLUMNS
) -> str:
    """The run's tables: speed and memory (a ``vs`` column for each baseline in ``ratios``), where the step
    goes, the loss guard, and the shape and software measured."""

    def fmt(value: Any, spec: str) -> str:
        return (
            "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
        )

    rows = [r for r in results if r["path"] != "matmul_peak"]
    lines = [
        # the ratios of the median step, which the targets of docs/benchmarks.md name; tokens/s (and MFU) count the
        # whole measured window, so one slow step of a path moves them and not its median
        "| path | tokens/s | MFU | step ms (median) | peak mem GiB | "
        + " | ".join(f"vs {name}" for name in ratios)
        + " (median steps) | GPU |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(ratios) + "---:|",
    ]
    for r in rows:
        if not r.get("ok"):
            lines.append(
                f"| {_label(r, results)} | failed: {str(r.get('error'))[:150]} |"
                + " |" * (3 + len(ratios))
                + f" {r.get('gpu')} |"
            )
            continue
        lines.append(
            f"| {_label(r, results)} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu', 0) * 100, '.1f')}% "
            f"| {fmt(_median(r, 'step_ms'), '.1f')} | {fmt(r.get('peak_mem_gib'), '.1f')} | "
            + " | ".join(fmt(r.get(f"median_vs_{name}"), ".2f") for name in ratios)
            + f" | {r.get('gpu')} |"
        )
    lines += [
        "",
        "| path | forward+loss ms | backward ms | optimizer ms | idle between steps ms | host syncs/step "
        "| first step s | warm-up s | peak mem in warm-up GiB | final loss | vs baseline's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.get("ok"):
            continue
        probe = r.get("sync_probe") or {}
        syncs = probe.get("syncs")
        native = probe.get("native_syncs", 0)
        per_step = None if syncs is None else (syncs + native) / max(1, meta["probe_steps"])
        lines.append(
            f"| {_label(r, results)} | {fmt(_median(r, 'forward_ms'), '.1f')} | {fmt(_median(r, 'backward_ms'), '.1f')} "
            f"| {fmt(_median(r, 'optimizer_ms'), '.1f')} | {fmt(_median(r, 'gap_ms'), '.2f')} | {fmt(per_step, '.1f')} "
            f"| {fmt(r.get('first_step_s'), '.1f')} | {fmt(r.get('warmup_s'), '.1f')} "
            f"| {fmt(r.get('peak_mem_warmup_gib'), '.1f')} | {fmt(r.get('final_loss'), '.4f')} "
            f"| {fmt(100 * r['loss_vs_baseline'] if 'loss_vs_baseline' in r else None, '+.2f')}% |"
        )
    failed = [_label(r, results) for r in rows if r.get("ok") and r.get("loss_ok") is False]
    lines += [
        "",
        f"loss guard (final loss finite and within {LOSS_TOLERANCE:.0%} of the baseline's): "
        + (f"FAILED for {', '.join(failed)}" if failed else "passed"),
    ]
    v = meta["versions"]
    peak = next((r for r in results if r["path"] == "matmul_peak" and r.get("ok")), None)
    lines += [
        "",
        f"shape: {meta['model']} (seq_len {meta['seq_len']}, micro-batch {meta['batch_size']}, "
        f"{meta['tokens_per_step']} tokens/step), warm-up {meta['warmup']} + {meta['steps']} measured steps; "
        f"{meta['flops_per_token'] / 1e9:.3f} GFLOP/token; MFU against {meta['peak_tflops']:g} TFLOP/s.",
        f"torch {v['torch']}, lightning {v['lightning']}, transformers {v['transformers']}, "
        f"triton {v['triton']}, CUDA {v['cuda']}, driver {v.get('driver')}, GPU {v.get('gpus')}; {meta['date']}.",
    ]
    if meta.get("gpu_stall_ms"):
        lines.append(f"host-bound probe: a {meta['gpu_stall_ms']:g} ms GPU spin queued at every step's start")
    if meta.get("note"):
        lines.append(f"note: {meta['note']}")
    if peak is not None:
        lines.append(
            f"measured bf16 matmul ({peak['matmul_n']}^3, random data): {peak['matmul_tflops']:.0f} TFLOP/s; "
            "MFU against it: "
            + ", ".join(
                f"{_label(r, results)} {100 * r['model_tflops'] / peak['matmul_tflops']:.1f}%"
                for r in rows
                if r.get("model_tflops")
            )
        )
    return "\n".join(lines)


def run_meta(args: argparse.Namespace, fpt: int, gpus: list[str]) -> dict[str, Any]:
    """What a run measured, for its JSON and the tables' last lines: shape, steps, recipe, software, command."""
    return {
        "date": args.date,
        # the depth where --layers set it, or where the name does not give it (moe_large's own, from its config)
        "model": MODEL_NAMES[args.model]
        + (f", {_config(args).num_hidden_layers} layers" if args.layers or args.model == "moe_large" else ""),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_step": args.batch_size * args.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "probe_steps": args.probe_steps,
        "gpu_stall_ms": args.gpu_stall_ms,
        "peak_tflops": args.peak_tflops,
        "flops_per_token": fpt,
        "precision": "fp32 master weights + torch.autocast(bf16) in the plain loops; bf16-mixed (FSDP2 "
        "MixedPrecisionPolicy) in ours_fsdp_loop and the Trainer paths",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1), fused on CUDA, constant lr, in the plain "
        "loops; the example's configure_optimizers (the same AdamW, fused on CUDA; its LambdaLR made constant: "
        "no warm-up, cosine over 10^9 steps) in the ours_trainer paths; the plain loops' AdamW in the hf_trainer "
        "paths",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "note": args.note,
        "gpus_used": gpus,
        "versions": versions(),
        "host": platform.node(),
    }


def versions() -> dict[str, Any]:
    """Library versions without initialising CUDA in the parent (the workers own the GPUs)."""
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "transformers", "triton"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    info["cuda"] = torch.version.cuda
    import lightning_d9d

    info["lightning_d9d"] = str(Path(lightning_d9d.__file__).resolve().parent)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["gpus"] = [line.strip() for line in smi.stdout.strip().splitlines()]
        info["driver"] = info["gpus"][0].split(", ")[2] if info["gpus"] else None
    except (OSError, subprocess.SubprocessError, IndexError):
        info["gpus"], info["driver"] = [], None
    return info
