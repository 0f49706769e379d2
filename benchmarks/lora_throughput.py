"""LoRA fine-tuning throughput on one GPU, in one run: ours through the Trainer against the recipe a strong user
writes without us (``transformers`` + ``peft`` + FSDP2 + per-layer ``torch.compile``, fused AdamW), on Qwen3-8B's
shape, or Qwen3-4B's where the baseline does not fit.

Every path trains the same adapters (``train_throughput.lora_config``: rank 16, alpha 32, no dropout, on q/k/v/o
and gate/up/down_proj of every decoder layer), the base frozen in bf16 with random weights, the adapters in fp32
(bf16 in the matmuls), on the same batches (``train_throughput._batches``: a fresh Zipf batch a step, the same for
every path), for the same steps, at a constant learning rate, from the same weights: the base as the strategy
initialises transformers' model built on meta (transformers' rules drawn from the seed and each module's name), the
adapters as the LoRA plan starts them (``A`` from the seed and the adapted layer's name in the Trainer paths'
LightningModule, ``B`` zero). The baseline's model and our white-box one are given those weights once built; each
path records digests of the weights its first step starts from (``start``: the frozen base and the adapters apart),
and a path whose start differs from the baseline's fails the run, as the loss guard would compare unlike runs. Each
path runs in its own process (``train_throughput.launch``: its own compile caches and peak memory), one after the
other on one GPU:

    peft_fsdp_compiled                 the baseline: transformers' Qwen3ForCausalLM built in bf16, peft's LoraConfig +
                                       get_peft_model, torch.compile and FSDP2 (bf16 MixedPrecisionPolicy, fp32
                                       reduction) per decoder layer and the root on one rank, fused AdamW over the
                                       adapters, causal_lm_loss on the logits
    hf_trainer_lora_compiled_nofsdp    the same transformers model built on meta in a LightningModule, under
                                       D9DStrategy(lora=LoRA(rank=16, alpha=32, base_dtype=torch.bfloat16),
                                       compile=True, fsdp_on_one_rank=False), precision="bf16-mixed", the loss through
                                       model_loss(..., causal_lm_loss) (the fused LM head + loss on CUDA), fused AdamW
                                       over the adapters
    ours_trainer_lora_compiled_nofsdp  our white-box Qwen3ForCausalLM in that module, under that strategy

(``hf_trainer_lora_compiled_nofsdp_selective``, by name: selective activation checkpointing, the memory lever.)

Shapes: ``--models`` in order (default ``8b,4b``); the first shape runs the baseline first, and if the baseline
runs out of memory it is recorded as "did not fit", the paths after it at that shape are not run (their time goes
to the next shape) and the next shape runs. The first shape whose baseline fits is the measurement.

Measured as ``train_throughput.py`` measures (its workers, ``derive``, ``check_losses``, ``markdown``): tokens/s over
the measured window, ratios of the median step (CUDA events), peak memory (``torch.cuda.max_memory_allocated`` over
the measured steps), and the loss guard: every path's final loss finite and within 2 % of the baseline's. MFU =
FLOPs per token x tokens/s / ``--peak-tflops`` (989, the H100/H200 SXM dense bf16 datasheet number), with FLOPs per
token = ``6 N_trained + 4 N_frozen + 12 L H head_dim T`` (``lightning_d9d/models/flops.py``): the frozen base's
backward computes only its input's gradient (2 + 2 FLOPs a weight), the adapters their own gradient too (6); the
input embedding is a lookup, not counted. The table below the run's says, per path, whether it met the fine-tuning
targets: >= 1.3x the baseline's tokens/s (median steps) at <= 0.7x its peak memory, final loss within 2 %.

The full fine-tune beside it (1.7B shape) uses ``train_throughput.py``'s own paths: ``benchmarks/h200_runs.sh
full1.7b``.

Writes under ``--out``: ``lora_throughput.md`` (every shape's tables), and per shape ``<model>/lora_throughput.json``
(meta and results) and ``<model>/lora_throughput.log`` (the workers' logs). Exits non-zero where the loss guard
failed, a path started from other weights than the baseline's, or a path failed for another reason than running
out of memory. ``--profile-steps N`` (train_throughput.py's) profiles N more steps of every path after its measured
window and writes ``<model>/profile_<path>.txt`` beside: device time per step by kind of kernel (the blocks',
the adapters' and the LM head's GEMMs, attention, the loss, element-wise, norms, the optimizer), where the GPU
waited, and the kernel table.

Run (on a CUDA GPU, from the repository root; every option of train_throughput.py passes through):

    PYTHONPATH=. python benchmarks/lora_throughput.py --compile-threads 16 --matmul-peak --out runs/lora
    PYTHONPATH=. python benchmarks/lora_throughput.py --models 8b --compile-threads 16 --matmul-peak \
        --profile-steps 2 --out runs/lora   # and each path's profile
    PYTHONPATH=. python benchmarks/lora_throughput.py --device cpu --models tiny --seq-len 32 --batch-size 2 \\
        --warmup 1 --steps 2   # CPU smoke run: minutes (Inductor compiles for the CPU); the numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import train_throughput as tt

BASELINE = "peft_fsdp_compiled"
DEFAULT_PATHS = (BASELINE, "hf_trainer_lora_compiled_nofsdp", "ours_trainer_lora_compiled_nofsdp")
# The fine-tuning targets: ours against the baseline, in one run
TARGET_SPEEDUP, TARGET_MEMORY = 1.3, 0.7
# Ahead of the caller's options (a later option wins): seq 4096; one sequence a step (by estimate 8B's bf16 weights,
# 16 GB, one sequence's activations and its [4096, vocab] logits with their fp32 copies fit an 80 GB card, two
# would not); 3 warm-up steps (compilation in the first) + 10 measured; a learning rate high enough for the adapters
# to move the loss in 13 steps (the targets table says how far they did)
DEFAULTS = ("--seq-len=4096", "--batch-size=1", "--warmup=3", "--steps=10", "--lr=1e-3", "--path-timeout=200")
NOT_RUN = "not run: the baseline did not fit this shape"

# (job, path, the shape's arguments, its log folder) -> the path's result: train_throughput.launch on one GPU
RunPath = Callable[[int, str, argparse.Namespace, Path], dict[str, Any]]


@dataclass
class ShapeRun:
    """One shape's run: its arguments, its FLOPs per token and what is recorded with it (``meta``), the paths'
    results in order, and whether its baseline fitted."""

    model: str
    args: argparse.Namespace
    fpt: int
    meta: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, model: str, args: argparse.Namespace) -> ShapeRun:
        fpt, params = lora_flops_per_token(args)
        return cls(model, args, fpt, lora_meta(args, fpt, params))

    @property
    def baseline_fitted(self) -> bool:
        return not any(r["path"] == BASELINE and did_not_fit(r) for r in self.results)


def did_not_fit(result: dict[str, Any]) -> bool:
    """The path ran out of GPU memory (``torch.OutOfMemoryError``, or CUDA's own "out of memory" error)."""
    return not result.get("ok") and "out of memory" in str(result.get("error", "")).lower()


def lora_flops_per_token(args: argparse.Namespace) -> tuple[int, Any]:
    """Training FLOPs per token of ``args``' shape with the LoRA paths' adapters, and the parameter counts behind it
    (trained: the adapters; frozen: the rest but the input embedding), counted on our model built on meta."""
    import torch

    from lightning_d9d.models.flops import AttentionShape, flop_params, training_flops_per_token
    from lightning_d9d.plans.lora import apply_lora

    config = tt._config(args)
    with torch.device("meta"):
        model = tt._model_class(config)(config)
    apply_lora(model, tt.lora_config(), seed=0)
    params = flop_params(model)
    attention = AttentionShape.of(config)
    assert attention is not None  # our configs give every size
    return training_flops_per_token(params, attention, args.seq_len), params


def launch_on(gpu: str) -> RunPath:
    def run(job: int, path: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
        return tt.launch(job, path, gpu, args, logdir)

    return run


def run_shapes(
    models: list[str], paths: list[str], options: list[str], out: Path, run: RunPath
) -> list[ShapeRun]:
    """Each shape in turn until one's baseline fits (see the module docstring); results written after each path."""
    runs: list[ShapeRun] = []
    peak: dict[str, Any] | None = None  # the bf16 matmul rate, measured once
    for model in models:
        args = tt.parse_args([*DEFAULTS, *options, f"--model={model}", f"--out={out / model}"])
        args.out.mkdir(parents=True, exist_ok=True)
        args.logdir = Path(tempfile.mkdtemp(prefix=f"lora_throughput_{model}_"))
        shape = ShapeRun.of(model, args)
        runs.append(shape)
        if args.matmul_peak and args.device == "cuda":
            peak = peak or run(0, "matmul_peak", args, args.logdir)
            shape.results.append(peak)
        for job, path in enumerate(paths, start=1):
            if not shape.baseline_fitted:
                shape.results.append({"path": path, "ok": False, "error": NOT_RUN, "job": job, "gpu": ""})
                continue
            shape.results.append(run(job, path, args, args.logdir))
            write(runs, out)
        write(runs, out)
        if shape.baseline_fitted:
            break
    return runs


def write(runs: list[ShapeRun], out: Path) -> str:
    """``lora_throughput.md`` under ``out`` (every shape), each shape's JSON and merged worker logs beside it."""
    sections = []
    for shape in runs:
        tt.derive(shape.results, shape.args, shape.fpt)
        sections.append(
            f"## {shape.meta['model']}\n\n{tt.markdown(shape.results, shape.meta, ratios=(BASELINE,))}\n\n"
            + targets_table(shape.results)
        )
        (shape.args.out / "lora_throughput.json").write_text(
            json.dumps({"meta": shape.meta, "results": shape.results}, indent=1)
        )
        tt.merge_logs(shape.args.logdir, shape.args.out / "lora_throughput.log")
    text = "# LoRA fine-tuning throughput\n\n" + "\n\n".join(sections) + "\n"
    (out / "lora_throughput.md").write_text(text)
    return text


def lora_meta(args: argparse.Namespace, fpt: int, params: Any) -> dict[str, Any]:
    meta = tt.run_meta(args, fpt, [args.gpus.split(",")[0]] if args.device == "cuda" else [""])
    lora = tt.lora_config()
    meta["lora"] = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "targets": list(lora.targets),
        "base_dtype": str(lora.base_dtype),
    }
    meta["flops"] = {
        "formula": "6 N_trained + 4 N_frozen + 12 L H head_dim T",
        "trained_params": params.trained,
        "frozen_params": params.frozen,
    }
    meta["precision"] = (
        "the base frozen in bf16, the adapters fp32: cast to bf16 by FSDP2's MixedPrecisionPolicy (fp32 "
        "reduction) in the baseline, by bf16-mixed's autocast on the Trainer paths (no FSDP on the one rank)"
    )
    meta["optimizer"] = (
        "AdamW(betas=(0.9, 0.95), weight_decay=0.1), fused on CUDA, constant lr, over the adapters"
    )
    meta["note"] = (
        f"MFU counts {fpt / 1e9:.3f} GFLOP/token = 6 x {params.trained:,} adapter + 4 x {params.frozen:,} frozen "
        f"parameters + attention. {args.note}"
    ).strip()
    return meta


def targets_table(results: list[dict[str, Any]]) -> str:
    """Each path against the baseline and the targets: speed (median steps), peak memory, final loss."""
    baseline = next((r for r in results if r["path"] == BASELINE), None)
    lines = [
        f"| path | tokens/s vs baseline (median steps; >= {TARGET_SPEEDUP}x) | peak memory vs baseline "
        f"(<= {TARGET_MEMORY}x) | final loss vs baseline (within {tt.LOSS_TOLERANCE:.0%}) | loss first -> last "
        "| weights at the start | targets |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if r["path"] == "matmul_peak":
            continue
        if not r.get("ok"):
            state = "did not fit (out of memory)" if did_not_fit(r) else str(r.get("error"))[:120]
            lines.append(f"| {r['path']} | {state} | | | | | |")
            continue
        speed = r.get(f"median_vs_{BASELINE}")
        memory = _memory_ratio(r, baseline)
        loss = r.get("loss_vs_baseline")
        losses = r.get("losses") or [math.nan]
        verdict = "baseline" if r is baseline else _verdict(speed, memory, r.get("loss_ok"))
        lines.append(
            f"| {r['path']} | {_fmt(speed, '.2f', 'x')} | {_fmt(memory, '.2f', 'x')} "
            f"| {_fmt(None if loss is None else 100 * loss, '+.2f', ' %')} "
            f"| {losses[0]:.4f} -> {losses[-1]:.4f} | {_start(r, baseline)} | {verdict} |"
        )
    if baseline is not None and did_not_fit(baseline):
        lines.append("\nThe baseline did not fit this shape: no ratios.")
    return "\n".join(lines)


def start_differs(result: dict[str, Any], baseline: dict[str, Any] | None) -> list[str] | None:
    """The parts of ``result``'s starting weights (``base``, ``adapters``) that differ from the baseline's; None
    where either recorded none."""
    if baseline is None or not result.get("start") or not baseline.get("start"):
        return None
    return [part for part, digest in baseline["start"].items() if result["start"].get(part) != digest]


def _start(result: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    differs = start_differs(result, baseline)
    if differs is None:
        return "–"
    return "as the baseline's" if not differs else "other " + " and ".join(differs)


def _memory_ratio(result: dict[str, Any], baseline: dict[str, Any] | None) -> float | None:
    if baseline is None or not baseline.get("peak_mem_gib") or result.get("peak_mem_gib") is None:
        return None
    return float(result["peak_mem_gib"]) / float(baseline["peak_mem_gib"])


def _verdict(speed: float | None, memory: float | None, loss_ok: bool | None) -> str:
    if speed is None or memory is None or loss_ok is None:
        return "not measured"
    missed = [
        name
        for name, met in (
            ("speed", speed >= TARGET_SPEEDUP),
            ("memory", memory <= TARGET_MEMORY),
            ("loss", loss_ok),
        )
        if not met
    ]
    return "met" if not missed else "missed: " + ", ".join(missed)


def _fmt(value: float | None, spec: str, unit: str) -> str:
    return "–" if value is None or math.isnan(value) else format(value, spec) + unit


def failed(runs: list[ShapeRun]) -> list[str]:
    """What makes the run fail: a path outside the loss band or started from other weights than the baseline's,
    or one that failed without running out of memory."""
    problems = []
    for shape in runs:
        baseline = next((r for r in shape.results if r["path"] == BASELINE), None)
        for r in shape.results:
            differs = start_differs(r, baseline)
            if differs:
                problems.append(
                    f"{shape.model} {r['path']}: started from other weights than the baseline's "
                    f"({', '.join(differs)}): its loss compares unlike runs"
                )
            if r.get("loss_ok") is False:
                problems.append(f"{shape.model} {r['path']}: final loss outside the band")
            elif not r.get("ok") and not did_not_fit(r) and r.get("error") != NOT_RUN:
                problems.append(f"{shape.model} {r['path']}: {str(r.get('error'))[:200]}")
    return problems


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other option is train_throughput.py's (--seq-len, --steps, --lr, --compile-threads, ...).",
        allow_abbrev=False,  # --model is train_throughput's option, not an abbreviation of --models
    )
    parser.add_argument("--models", default="8b,4b", help="shapes in order: the first whose baseline fits")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help="comma list of LoRA paths")
    parser.add_argument("--out", type=Path, default=Path("runs/lora"))
    args, options = parser.parse_known_args(argv)
    if any(option.split("=")[0] == "--model" for option in options):
        parser.error("--model: name the shapes with --models (in order: the first whose baseline fits)")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in tt.LORA_PATHS]
    if unknown:
        parser.error(f"--paths: {unknown} are not LoRA paths; choose from {', '.join(tt.LORA_PATHS)}")
    # the baseline first: whether a shape fits is its question
    args.paths = sorted(paths, key=lambda p: p != BASELINE)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    return args, options


def main(argv: list[str] | None = None) -> None:
    args, options = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    first = tt.parse_args([*DEFAULTS, *options])  # the options checked before any path starts
    gpu = (
        first.gpus.split(",")[0] if first.device == "cuda" else ""
    )  # one GPU: the paths run one after another
    runs = run_shapes(args.models, args.paths, options, args.out, launch_on(gpu))
    print(write(runs, args.out), flush=True)
    problems = failed(runs)
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
