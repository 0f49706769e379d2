"""The parent of a ``train_throughput.py`` run: every path in a fresh interpreter pinned to one GPU (its own
compile caches unless ``--shared-compile-cache``), the paths spread over ``--gpus``, the host syncs C++ printed
counted from each worker's log, and the run's files under ``--out`` rewritten after each path (JSON, Markdown
tables, the merged log)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .instruments import SyncProbe
from .paths import LORA_PATHS, PATHS, path_environment
from .report import derive, markdown, run_meta
from .shapes import flops_per_token

REPO = Path(__file__).resolve().parents[2]
#: The script each worker runs (``--worker <path>``).
SCRIPT = REPO / "benchmarks" / "train_throughput.py"


def launch(job: int, path: str, gpu: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Run one path in a fresh interpreter pinned to one GPU; its result is the last JSON line it prints."""
    env = dict(os.environ)
    # An explicit PYTHONPATH (a snapshot of the package, say) comes before the working tree.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(REPO)]))
    env["PYTHONUNBUFFERED"] = "1"
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(29500 + 17 * job + int(gpu or 0))
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if args.compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    env.update(path_environment(path))
    if not args.shared_compile_cache:  # cold compile caches: warm-up times do not depend on the path order
        env["TORCHINDUCTOR_CACHE_DIR"] = str(logdir / f"{job:02d}_inductor")
        env["TRITON_CACHE_DIR"] = str(logdir / f"{job:02d}_triton")
    cmd = [sys.executable, str(SCRIPT), "--worker", path, *args.passthrough]
    log = logdir / f"{job:02d}_{path}.log"
    start = time.perf_counter()
    with log.open("w") as handle:
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=args.path_timeout
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"path": path, "ok": False, "error": f"worker exit {rc}, no result"}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            break
    probe = result.get("sync_probe")
    if probe is not None:  # syncs that C++ printed (no Python frame) between the probe's markers
        lines = log.read_text(errors="replace").splitlines()
        if SyncProbe.START in lines and SyncProbe.END in lines:
            start = len(lines) - 1 - lines[::-1].index(SyncProbe.START)
            window = lines[start : lines.index(SyncProbe.END, start)]
            probe["native_syncs"] = sum("synchronizing CUDA operation" in line for line in window)
    if rc != 0 and result.get("ok"):
        result["note"] = f"worker exit {rc} after reporting"
    result.update({"job": job, "gpu": gpu, "wall_s": wall})
    status = "ok" if result.get("ok") else f"FAILED ({result.get('error')})"
    print(f"[{time.strftime('%H:%M:%S')}] gpu {gpu}: {path} {status} in {wall:.0f}s", flush=True)
    if not result.get("ok"):
        print("\n".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    return result


def run(args: argparse.Namespace) -> None:
    """Every path of ``--paths`` through :func:`launch`, then the tables; exits non-zero when the loss guard fails."""
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    lora = [p for p in paths if p in LORA_PATHS]
    if lora:  # their MFU counts the frozen weights apart, and their baseline is peft's
        raise SystemExit(f"{lora} are LoRA paths: run them with benchmarks/lora_throughput.py")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    if args.matmul_peak and args.device == "cuda":
        paths = ["matmul_peak", *paths]
    gpus = [g.strip() for g in args.gpus.split(",")] if args.device == "cuda" else [""]
    args.out.mkdir(parents=True, exist_ok=True)
    # Per-path logs, merged into one file under --out after each path.
    logdir = args.logdir = Path(tempfile.mkdtemp(prefix="train_throughput_"))
    fpt = flops_per_token(args)
    meta = run_meta(args, fpt, gpus)
    print(f"paths: {paths} on GPUs {gpus}; {fpt / 1e9:.3f} GFLOP/token", flush=True)

    jobs: queue.Queue[tuple[int, str]] = queue.Queue()
    # Compiling paths take longest: start them first so that several GPUs finish together.
    for job, path in sorted(
        enumerate(paths), key=lambda jp: (jp[1] != "matmul_peak", "compiled" not in jp[1])
    ):
        jobs.put((job, path))
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def drain(gpu: str) -> None:
        while True:
            try:
                job, path = jobs.get_nowait()
            except queue.Empty:
                return
            result = launch(job, path, gpu, args, logdir)
            with lock:
                results.append(result)
                _write(args.out, meta, sorted(results, key=lambda r: r["job"]), args, fpt)

    threads = [threading.Thread(target=drain, args=(gpu,)) for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.sort(key=lambda r: r["job"])
    table = _write(args.out, meta, results, args, fpt)
    print(table, flush=True)
    if any(r.get("loss_ok") is False for r in results):
        raise SystemExit("loss guard failed: a path's final loss is not within the band (see the table)")


def _write(
    out: Path,
    meta: dict[str, Any],
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    fpt: int,
) -> str:
    derive(results, args, fpt)
    table = markdown(results, meta)
    (out / "train_throughput.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "train_throughput.md").write_text(table + "\n")
    merge_logs(args.logdir, out / "train_throughput.log")
    return table


def merge_logs(logdir: Path, target: Path) -> None:
    """All worker logs in one file (the device tool returns few files), rewritten as paths finish."""
    with target.open("w") as handle:
        for log in sorted(logdir.glob("*.log")):
            handle.write(f"===== {log.name}\n{log.read_text(errors='replace')}\n")
