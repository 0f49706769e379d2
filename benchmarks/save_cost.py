"""The step-time cost of a checkpoint save, synchronous against ``D9DStrategy(async_save=True)``, on one GPU or
(``--devices 2``: each path under torchrun, ``dp_shard=2``, seq 4096 x 4 per GPU) on several.

    PYTHONPATH=. python benchmarks/save_cost.py --out save_cost.json [--steps 24 --every 6 --dir /tmp/ckpt]
    PYTHONPATH=. python benchmarks/save_cost.py --devices 2 --out save_cost_dp2.json
    PYTHONPATH=. python benchmarks/save_cost.py --devices 2 --device cpu --model tiny --seq-len 32  # smoke

Each path trains the example's Qwen3Pretraining at the Qwen3-0.6B shape (``Trainer(strategy=D9DStrategy(
compile=True), precision="bf16-mixed")``, seq 4096 x 4) with a ``ModelCheckpoint`` every ``--every`` steps
(fp32 parameters and AdamW state: ~7.2 GB per checkpoint), in a process of its own. The host clock is read at
every batch end after a CUDA synchronisation, so a step's time includes what its save kept the training thread
from doing (the whole write when synchronous; the copy to CPU memory when asynchronous) and any slow-down of
the steps that run beside a background write. The end of ``fit`` (where the last background save completes) is
timed too. Reported per path: the median step without a save, the steps that saved, the steps right after,
and the cost per save: (wall time of all measured steps + the end of fit - steps x median step) / saves.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PATHS = ("sync", "async")


def run(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, Dataset

    import lightning_d9d
    from lightning_d9d import D9DStrategy
    from lightning_d9d.models import Qwen3Config

    sys.path.insert(0, str(Path(lightning_d9d.__file__).resolve().parents[1] / "examples"))
    logging.basicConfig(level=logging.INFO)  # the async path logs what the training thread waited for
    from pretrain_qwen3 import Qwen3Pretraining

    config = Qwen3Config.qwen3_0_6b() if args.model == "0.6b" else Qwen3Config.tiny()
    cuda = args.device == "cuda"
    devices = int(os.environ.get("WORLD_SIZE", "1"))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warmup, total = 3, 3 + args.steps
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (4, args.seq_len + 1), generator=generator)

    class Repeat(Dataset):
        def __len__(self) -> int:
            return 4 * total

        def __getitem__(self, index: int) -> dict[str, Any]:
            row = ids[index % 4]
            return {"input_ids": row[:-1], "labels": row[1:]}

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            sync()
            self.ends.append(time.perf_counter())

    folder = Path(args.dir) / path
    shutil.rmtree(folder, ignore_errors=True)
    clock = Clock()
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=args.every, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        strategy=D9DStrategy(compile=cuda, async_save=path == "async"),  # dp_shard over all ranks
        accelerator="gpu" if cuda else "cpu",
        devices=devices,
        precision="bf16-mixed",
        max_steps=total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[clock, saver],
    )
    # how long the strategy's save_checkpoint held the training thread (the rest of a saving step's extra time
    # is Lightning's: building the checkpoint dict)
    inside_save: list[float] = []
    strategy_save = trainer.strategy.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        strategy_save(*args, **kwargs)
        sync()
        inside_save.append((time.perf_counter() - started) * 1e3)

    trainer.strategy.save_checkpoint = timed_save  # type: ignore[method-assign]
    module = Qwen3Pretraining(config, lr=1e-4, warmup_steps=0, max_steps=10**9)
    trainer.fit(module, DataLoader(Repeat(), batch_size=4))
    fit_end = time.perf_counter()
    steps = [(b - a) * 1e3 for a, b in zip(clock.ends, clock.ends[1:], strict=False)]  # step i+1's time
    measured = steps[warmup - 1 :]  # steps warmup+1 .. total
    numbers = list(range(warmup + 1, total + 1))
    saving = [ms for n, ms in zip(numbers, measured, strict=True) if n % args.every == 0]
    after = [ms for n, ms in zip(numbers, measured, strict=True) if n % args.every == 1 and n > 1]
    plain = [ms for n, ms in zip(numbers, measured, strict=True) if n % args.every not in (0, 1)]
    median = statistics.median(plain)
    end_ms = (fit_end - clock.ends[-1]) * 1e3
    wall = sum(measured) + end_ms
    saves = sum(1 for n in numbers if n % args.every == 0)
    complete = sorted(p.name for p in folder.iterdir() if (p / "manifest.json").is_file())
    size = sum(f.stat().st_size for f in (folder / complete[-1]).rglob("*") if f.is_file()) if complete else 0
    trainer.strategy.barrier()  # every rank measured the folder before rank 0 removes it
    if trainer.global_rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "path": path,
        "devices": devices,
        "rank": trainer.global_rank,
        "median_step_ms": median,
        "saving_steps_ms": saving,
        "steps_after_save_ms": after,
        "end_of_fit_ms": end_ms,
        "strategy_save_ms": inside_save,
        "saves": saves,
        "cost_per_save_ms": (wall - len(measured) * median) / saves,
        "complete_checkpoints": complete,
        "checkpoint_bytes": size,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dir", default="/tmp/save_cost")
    parser.add_argument("--devices", type=int, default=1, help="> 1: each path under torchrun at dp_shard=N")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=["0.6b", "tiny"], default="0.6b")
    parser.add_argument("--out", type=Path, default=Path("save_cost.json"))
    parser.add_argument("--path", choices=PATHS, help="run one path in this process (the driver's workers)")
    args = parser.parse_args()
    if args.path:
        result = run(args.path, args)
        if result["rank"] == 0:  # rank 0's clock (dp ranks step together)
            print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for path in PATHS:
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.devices)]
        command = [
            sys.executable,
            *(launch if args.devices > 1 else []),
            __file__,
            "--path",
            path,
            *sys.argv[1:],
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{path} failed ({done.returncode})")
        for line in done.stderr.splitlines():  # what the async path's training thread waited for
            if "async save of" in line:
                print(line, flush=True)
        results.append(json.loads(lines[-1][len("RESULT ") :]))
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=2))


if __name__ == "__main__":
    main()
