"""Optimizers on one GPU through the product's path: what a step costs, how much of it is the optimizer, what
memory it takes, what loss it reaches, and which Qwen3 shape it lets one GPU train at all.

Every run trains our Qwen3 (``examples/pretrain_qwen3.py``'s ``Qwen3Pretraining``, the loss through
``model_loss``: the fused LM head + cross-entropy) under ``Trainer(strategy=D9DStrategy(compile=True))`` on
``train_throughput.py``'s batches (a fresh Zipf batch a step, the same for every run) at a constant learning rate,
each in its own process (its own compile caches and peak memory), one after another on one GPU:

    adamw              torch.optim.AdamW(fused=True) over fp32 parameters: precision="bf16-mixed" (the strategy's
                       default, FSDP2's MixedPrecisionPolicy casting them for the forward)
    stochastic         StochasticAdamW over bf16 parameters, bf16 moments, no masters: precision="bf16-true", its
                       fused Triton step (LIGHTNING_D9D_KERNELS=triton)
    stochastic_master  StochasticAdamW(master_weights=True): fp32 masters, bf16 moments, bf16-true, fused step
    muon               Muon over muon_param_groups (the blocks' matrices; AdamW for the embedding, head and norms),
                       fp32 parameters, bf16-mixed
    stochastic_torch   stochastic with its chunked torch step (LIGHTNING_D9D_KERNELS=reference): the kernel's gain
    plain              the plain recipe: train_throughput.py's hf_fsdp_compiled (transformers' Qwen3, FSDP2 + per-
                       layer compile, fused AdamW, the loss on the logits) through its own worker

Per run (``--models``, default the 0.6B and 1.7B shapes; ``--optimizers``, default the first four; ``--seq-len``
4096 and 4 sequences a step unless given): the median step (CUDA events at step boundaries), the optimizer's step
alone (CUDA events from ``on_before_optimizer_step`` to the end of ``optimizer.step``; the plain loop's from the end
of backward to the end of ``zero_grad``), tokens/s over the measured window, MFU (``Qwen3ForCausalLM
.num_flops_per_token`` x tokens/s / ``--peak-tflops``), peak memory (``torch.cuda.max_memory_allocated`` over the
whole run), and the loss after the same steps on the same data. The guard: every run's final loss finite, and where
the math is AdamW's (stochastic*: only the rounding differs) within 2 % of adamw's (``train_throughput
.LOSS_TOLERANCE``, the band of runs that differ in bf16 rounding); Muon's and the plain recipe's (another model's
initialisation) are reported beside it.

``--largest``: for each optimizer (``plain`` included), the largest of ``--shapes`` (default 8b,4b,1.7b,0.6b, tried
in that order) that trains at all: one step and three more, activation checkpointing of every block
(``activation_checkpointing="full"``) and the fused loss on; a try that runs out of memory moves to the next shape
(each try its own process: nothing of it stays on the GPU). ``plain`` is built as the baseline is (no recompute).

Each run takes a compile and its steps, about one to two minutes; split the work over calls of ten minutes by
``--models``, ``--optimizers`` and ``--shapes``. Writes under ``--out`` (the files rewritten after each run):
``optimizer_speed.{json,md,log}``, or ``optimizer_largest.{json,md,log}`` with ``--largest``; exits non-zero where the
guard failed or a run failed (other than running out of memory while looking for the largest shape).

    PYTHONPATH=. python benchmarks/optimizer_speed.py --models 0.6b --out $OUT/optimizers
    PYTHONPATH=. python benchmarks/optimizer_speed.py --largest --optimizers stochastic,plain --out $OUT/largest
    PYTHONPATH=. python benchmarks/optimizer_speed.py --device cpu --models tiny --seq-len 64 --batch-size 2 \\
        --warmup 1 --steps 2 --no-compile --out /tmp/optimizers   # CPU smoke run; the numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import train_throughput as tt
from lora_throughput import did_not_fit
from throughput.instruments import _device, _ms, _sync

SCRIPT = Path(__file__).resolve()
OPTIMIZERS = {
    "adamw": "torch.optim.AdamW(fused=True), fp32 parameters (bf16-mixed)",
    "stochastic": "StochasticAdamW, bf16 parameters and moments, no masters (bf16-true), fused step",
    "stochastic_master": "StochasticAdamW(master_weights=True), fp32 masters, bf16 moments (bf16-true), fused step",
    "muon": "Muon over muon_param_groups, AdamW for the rest, fp32 parameters (bf16-mixed)",
    "stochastic_torch": "StochasticAdamW as stochastic, its chunked torch step",
    "plain": "transformers + FSDP2 + per-layer compile + fused AdamW (train_throughput.py's hf_fsdp_compiled)",
}
DEFAULT_OPTIMIZERS = ("adamw", "stochastic", "stochastic_master", "muon")
PLAIN_PATH = "hf_fsdp_compiled"
PRECISION = {"stochastic": "bf16-true", "stochastic_master": "bf16-true", "stochastic_torch": "bf16-true"}
# $LIGHTNING_D9D_KERNELS per run: "triton" runs StochasticAdamW's fused step whether or not its GPU test has let
# "auto" take it (every other kernel is GPU-checked, so "triton" changes nothing else on CUDA)
KERNELS = {"stochastic": "triton", "stochastic_master": "triton", "stochastic_torch": "reference"}
ADAMW_FAMILY = ("stochastic", "stochastic_master", "stochastic_torch")
# Ahead of the caller's options (a later option wins): seq 4096, 4 sequences a step, 5 warm-up + 20 measured steps
DEFAULTS = (
    "--seq-len=4096",
    "--batch-size=4",
    "--warmup=5",
    "--steps=20",
    "--probe-steps=0",
    "--time-adamw=0",
)
LARGEST_DEFAULTS = (*DEFAULTS, "--warmup=1", "--steps=3")
LARGEST_SHAPES = "8b,4b,1.7b,0.6b"

# (job, optimizer, the run's train_throughput arguments, recompute, its log folder) -> the run's result
RunOne = Callable[[int, str, argparse.Namespace, bool, Path], dict[str, Any]]


# ------------------------------------------------------------------------------------------------ the worker
def build_optimizer(name: str, model: Any, lr: float, cuda: bool) -> Any:
    import torch

    from lightning_d9d.optim import Muon, StochasticAdamW, muon_param_groups

    hyper: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), **hyper, fused=cuda)
    if name == "muon":
        return Muon(muon_param_groups(model), **hyper)
    return StochasticAdamW(model.parameters(), **hyper, master_weights=name == "stochastic_master")


def train(name: str, args: argparse.Namespace, recompute: bool, compile_blocks: bool) -> dict[str, Any]:
    """One optimizer's run in this process (the worker): warm-up, the measured window, the result."""
    import itertools

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    import lightning_d9d
    from lightning_d9d import D9DStrategy
    from lightning_d9d.callbacks import GarbageCollection
    from lightning_d9d.kernels import dispatch

    sys.path.insert(0, str(Path(lightning_d9d.__file__).resolve().parents[1] / "examples"))
    from pretrain_qwen3 import Qwen3Pretraining

    # which paths this run takes is read from the kernels' announcements: forget any made before it in this process
    dispatch._ANNOUNCED.discard("stochastic_adamw_step")
    device = _device(args)
    cuda = device.type == "cuda"
    config = tt._config(args)
    torch.manual_seed(args.seed)
    inputs, labels = tt._batches(args, config.vocab_size, torch.device("cpu"))
    total = args.warmup + args.steps
    marks: dict[str, list[Any]] = {"step_end": [], "optimizer_start": [], "optimizer_end": []}
    window: dict[str, float] = {}  # host clock: the start, the first step's end, the measured window's ends
    losses: list[Any] = []

    def mark(kind: str) -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks[kind].append(event)

    class Batches(Dataset):
        def __len__(self) -> int:
            return total * args.batch_size

        def __getitem__(self, index: int) -> dict[str, Any]:
            step, i = divmod(index, args.batch_size)
            return {"input_ids": inputs[step, i], "labels": labels[step, i]}

    class Pretraining(Qwen3Pretraining):
        """The example's module with the optimizer under test (constant lr) and its step timed."""

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return build_optimizer(name, self.model, args.lr, cuda)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            mark("optimizer_start")

        def optimizer_step(self, *step_args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*step_args, **kwargs)
            mark("optimizer_end")

    class Window(Callback):
        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            _sync(device)
            window["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            losses.append(outputs["loss"].detach() if isinstance(outputs, dict) else outputs)
            mark("step_end")
            for step, key in ((0, "first"), (args.warmup - 1, "t0"), (total - 1, "t1")):
                if batch_idx == step:
                    _sync(device)
                    window[key] = time.perf_counter()

    trainer = L.Trainer(
        strategy=D9DStrategy(compile=compile_blocks, activation_checkpointing="full" if recompute else False),
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision=PRECISION.get(name, "bf16-mixed"),
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the batches in their order (train_throughput's trainer_loop says why)
        callbacks=[Window(), GarbageCollection()],
    )
    module = Pretraining(config, lr=args.lr, warmup_steps=0, max_steps=10**9)
    trainer.fit(module, DataLoader(Batches(), batch_size=args.batch_size, num_workers=0))
    assert module.model is not None
    measured = slice(args.warmup, total)
    result: dict[str, Any] = {
        "n_params": sum(p.numel() for p in module.model.parameters()),
        "optimizer_repr": repr(trainer.optimizers[0]).replace("\n", " ")[:300],
        "precision": PRECISION.get(name, "bf16-mixed"),
        "activation_checkpointing": "full" if recompute else None,
        "compile": compile_blocks,
        "first_step_s": window["first"] - window["start"],
        "elapsed_s": window["t1"] - window["t0"],
        "losses": [float(x) for x in losses],
        "fused_loss": "fused" in getattr(sys.modules.get("lightning_d9d.loss.head"), "_ANNOUNCED", set()),
    }
    if name in KERNELS:  # which step StochasticAdamW took: the kernel announces itself once per process
        result["stochastic_step"] = "fused" if "stochastic_adamw_step" in dispatch._ANNOUNCED else "torch"
    if cuda:
        ends = marks["step_end"][args.warmup - 1 : total]
        result["step_ms"] = tt._summary([_ms(a, b) for a, b in itertools.pairwise(ends)])
        starts, stops = marks["optimizer_start"][measured], marks["optimizer_end"][measured]
        result["optimizer_ms"] = tt._summary([_ms(a, b) for a, b in zip(starts, stops, strict=True)])
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["gpu_name"] = torch.cuda.get_device_name(device)
    return result


def worker(name: str, args: argparse.Namespace, recompute: bool, compile_blocks: bool) -> dict[str, Any]:
    import traceback

    result: dict[str, Any] = {"optimizer": name}
    try:
        result.update(train(name, args, recompute, compile_blocks))
        result["ok"] = True
    except Exception as error:  # reported in the table; the other runs still run
        traceback.print_exc()
        result.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000])
    return result


# ------------------------------------------------------------------------------------------------ the parent
def launch_on(gpu: str, compile_blocks: bool) -> RunOne:
    """Each run in a fresh interpreter pinned to ``gpu``: ours through this script's worker, ``plain`` through
    train_throughput.py's (``train_throughput.launch``)."""

    def run(job: int, name: str, args: argparse.Namespace, recompute: bool, logdir: Path) -> dict[str, Any]:
        if name == "plain":
            return {**tt.launch(job, PLAIN_PATH, gpu, args, logdir), "optimizer": name}
        env = dict(os.environ, PYTHONUNBUFFERED="1", LIGHTNING_D9D_KERNELS=KERNELS.get(name, "auto"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(tt.REPO)]))
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if args.compile_threads:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
        if not args.shared_compile_cache:  # cold compile caches, as train_throughput.py's runs
            env["TORCHINDUCTOR_CACHE_DIR"] = str(logdir / f"{job:02d}_inductor")
            env["TRITON_CACHE_DIR"] = str(logdir / f"{job:02d}_triton")
        flags = [*(["--recompute"] if recompute else []), *([] if compile_blocks else ["--no-compile"])]
        cmd = [sys.executable, str(SCRIPT), "--worker", name, *flags, *args.passthrough]
        log = logdir / f"{job:02d}_{name}_{args.model}.log"
        start = time.perf_counter()
        with log.open("w") as handle:
            try:
                subprocess.run(
                    cmd,
                    cwd=tt.REPO,
                    env=env,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    timeout=args.path_timeout,
                )
                error = "worker exited without a result"
            except subprocess.TimeoutExpired:
                error = f"timeout after {args.path_timeout} s"
        result: dict[str, Any] = {"optimizer": name, "ok": False, "error": error}
        for line in reversed(log.read_text(errors="replace").splitlines()):
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
                break
        result.update(job=job, gpu=gpu, wall_s=time.perf_counter() - start)
        print(
            f"[{time.strftime('%H:%M:%S')}] {args.model} {name}: {'ok' if result.get('ok') else result.get('error')}",
            flush=True,
        )
        return result

    return run


def derive(result: dict[str, Any], args: argparse.Namespace, fpt: int) -> dict[str, Any]:
    """tokens/s over the measured window, model TFLOP/s and MFU, the final loss; the shape and the tokens a step."""
    result.update(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size)
    if result.get("ok") and result.get("elapsed_s"):
        result["tokens_per_s"] = args.batch_size * args.seq_len * args.steps / result["elapsed_s"]
        result["model_tflops"] = fpt * result["tokens_per_s"] / 1e12
        result["mfu"] = result["model_tflops"] / args.peak_tflops
    if result.get("losses"):
        result["final_loss"] = result["losses"][-1]
    return result


def check_losses(results: list[dict[str, Any]]) -> None:
    """The guard (module docstring): ``loss_ok`` and, against adamw's run of the shape, ``loss_vs_adamw``."""
    for r in results:
        if not r.get("ok") or not r.get("losses"):
            continue
        final = r["losses"][-1]
        r["loss_ok"] = math.isfinite(final)
        adamw = next(
            (a for a in results if a["optimizer"] == "adamw" and a.get("ok") and a["model"] == r["model"]),
            None,
        )
        if adamw is not None and r["optimizer"] != "plain":  # plain: another model's initialisation
            r["loss_vs_adamw"] = final / adamw["losses"][-1] - 1
            if r["optimizer"] in ADAMW_FAMILY:
                r["loss_ok"] = r["loss_ok"] and abs(r["loss_vs_adamw"]) <= tt.LOSS_TOLERANCE


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def speed_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | optimizer | step ms (median) | optimizer step ms (median) | tokens/s | MFU | peak mem GiB "
        "| loss first -> last | vs adamw's | guard | ran |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        head = f"| {r['model']} | {r['optimizer']}"
        if not r.get("ok"):
            state = "out of memory" if did_not_fit(r) else str(r.get("error"))[:150]
            lines.append(f"{head} | {state} |" + " |" * 9)
            continue
        step, optimizer = (r.get(key) or {} for key in ("step_ms", "optimizer_ms"))
        loss = r.get("loss_vs_adamw")
        lines.append(
            f"{head} | {_fmt(step.get('median'), '.1f')} | {_fmt(optimizer.get('median'), '.2f')} "
            f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(100 * r['mfu'] if 'mfu' in r else None, '.1f')}% "
            f"| {_fmt(r.get('peak_mem_gib'), '.1f')} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} "
            f"| {_fmt(None if loss is None else 100 * loss, '+.2f')}% | {'ok' if r.get('loss_ok') else 'FAILED'} "
            f"| {_how(r)} |"
        )
    return "\n".join(lines)


def _how(result: dict[str, Any]) -> str:
    """What the run took: the fused LM head + loss or the logits' loss; StochasticAdamW's fused or torch step."""
    if result["optimizer"] == "plain":
        return "loss on the logits"
    parts = ["fused loss" if result.get("fused_loss") else "loss on the logits"]
    if result.get("stochastic_step"):
        parts.append(f"{result['stochastic_step']} step")
    return ", ".join(parts)


def largest_table(results: list[dict[str, Any]], optimizers: list[str]) -> str:
    lines = [
        "| optimizer | largest shape that trains | peak mem GiB | tokens/s | MFU | tries |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in optimizers:
        tries = [r for r in results if r["optimizer"] == name]
        fits = next((r for r in tries if r.get("ok")), None)
        tried = ", ".join(
            f"{r['model']}: "
            + ("fits" if r.get("ok") else "out of memory" if did_not_fit(r) else str(r.get("error"))[:80])
            for r in tries
        )
        if fits is None:
            lines.append(f"| {name} | none of those tried | | | | {tried} |")
            continue
        lines.append(
            f"| {name} | {fits['model']} | {_fmt(fits.get('peak_mem_gib'), '.1f')} "
            f"| {_fmt(fits.get('tokens_per_s'), ',.0f')} | {_fmt(100 * fits['mfu'] if 'mfu' in fits else None, '.1f')}% "
            f"| {tried} |"
        )
    return "\n".join(lines)


def run_speed(
    models: list[str], optimizers: list[str], options: list[str], out: Path, run: RunOne, compile_blocks: bool
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    logdir = Path(tempfile.mkdtemp(prefix="optimizer_speed_"))
    for model in models:
        args = tt.parse_args([*DEFAULTS, *options, f"--model={model}", f"--out={out}"])
        fpt = tt.flops_per_token(args)
        for name in optimizers:
            results.append(derive(run(len(results), name, args, False, logdir), args, fpt))
            check_losses(results)
            write(out, "optimizer_speed", args, results, speed_table(results), logdir, compile_blocks)
    return results


def run_largest(
    shapes: list[str], optimizers: list[str], options: list[str], out: Path, run: RunOne, compile_blocks: bool
) -> list[dict[str, Any]]:
    """Each optimizer's shapes in order until one trains (module docstring)."""
    results: list[dict[str, Any]] = []
    logdir = Path(tempfile.mkdtemp(prefix="optimizer_largest_"))
    for name in optimizers:
        for model in shapes:
            args = tt.parse_args([*LARGEST_DEFAULTS, *options, f"--model={model}", f"--out={out}"])
            result = derive(run(len(results), name, args, True, logdir), args, tt.flops_per_token(args))
            results.append(result)
            write(
                out,
                "optimizer_largest",
                args,
                results,
                largest_table(results, optimizers),
                logdir,
                compile_blocks,
            )
            if not did_not_fit(result):
                break
    return results


def write(
    out: Path,
    stem: str,
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    table: str,
    logdir: Path,
    compile_blocks: bool,
) -> None:
    meta = tt.run_meta(
        args, tt.flops_per_token(args), [args.gpus.split(",")[0]] if args.device == "cuda" else [""]
    )
    meta.update(
        model="per result (model)",
        precision="per optimizer (module docstring)",
        optimizer="lr --lr constant, betas (0.9, 0.95), weight decay 0.1; "
        + "; ".join(f"{k}: {v}" for k, v in OPTIMIZERS.items()),
        compile=compile_blocks,
    )
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    tt.merge_logs(logdir, out / f"{stem}.log")


def failed(results: list[dict[str, Any]], largest: bool) -> list[str]:
    problems = []
    for r in results:
        if r.get("loss_ok") is False:
            problems.append(f"{r['model']} {r['optimizer']}: final loss outside the guard")
        elif not r.get("ok") and not (largest and did_not_fit(r)):
            problems.append(f"{r['model']} {r['optimizer']}: {str(r.get('error'))[:200]}")
    return problems


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other option is train_throughput.py's (--seq-len, --steps, --lr, --compile-threads, ...).",
        allow_abbrev=False,
    )
    parser.add_argument("--models", default="0.6b,1.7b", help="shapes to time (speed mode)")
    parser.add_argument(
        "--optimizers", default=",".join(DEFAULT_OPTIMIZERS), help=f"comma list of {list(OPTIMIZERS)}"
    )
    parser.add_argument("--largest", action="store_true", help="find each optimizer's largest shape instead")
    parser.add_argument("--shapes", default=LARGEST_SHAPES, help="--largest: the shapes, largest first")
    parser.add_argument("--no-compile", action="store_true", help="blocks eager (a CPU smoke run)")
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/optimizers")))
    args, options = parser.parse_known_args(argv)
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in args.optimizers if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {list(OPTIMIZERS)}")
    if not args.worker and any(option.split("=")[0] == "--model" for option in options):
        parser.error("--model: name the shapes with --models (or --shapes with --largest)")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.shapes = [m.strip() for m in args.shapes.split(",") if m.strip()]
    return args, options


def main(argv: list[str] | None = None) -> None:
    args, options = parse_args(argv)
    compile_blocks = not args.no_compile
    if args.worker:  # one run, in this process: options are the parent's train_throughput arguments
        run_args = tt.parse_args(options)
        print(
            "RESULT " + json.dumps(worker(args.worker, run_args, args.recompute, compile_blocks)), flush=True
        )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    first = tt.parse_args([*DEFAULTS, *options])  # the options checked before any run starts
    run = launch_on(first.gpus.split(",")[0] if first.device == "cuda" else "", compile_blocks)
    if args.largest:
        results = run_largest(args.shapes, args.optimizers, options, args.out, run, compile_blocks)
        print(largest_table(results, args.optimizers), flush=True)
    else:
        results = run_speed(args.models, args.optimizers, options, args.out, run, compile_blocks)
        print(speed_table(results), flush=True)
    problems = failed(results, args.largest)
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
