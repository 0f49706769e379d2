"""Each layout of a ``layouts.jsonl`` (``benchmarks/layouts.py``'s lines) against its reference, and a loss guard.

    python benchmarks/compare_layouts.py runs/h200x2/layouts/layouts.jsonl [--tolerance 0.02]

Rows group by what must match for their losses to compare: impl, model, seq_len, global batch, steps and
whether the head is tied. A
group's reference is its one-GPU (one-process) bf16 row, else its first row (the fp8 part's bf16 dp_shard=2, the
async-TP part's plain tp=2). Per row: tokens/s per GPU and the fullest rank's peak memory against the reference,
and the final loss and the mean of the last 10 losses relative to the reference's.

The guard: every row's final loss finite and within ``--tolerance`` (relative) of its reference, else exit 1. The
2 % default is ``train_throughput.py``'s loss guard on the same data (Zipf-like tokens a model learns smoothly):
there paths whose numerics differ only by bf16 rounding (fused vs unfused kernels, another reduction order, FSDP
vs one process) end within a fraction of a percent of each other after 25 steps, while a layout that does not
train (wrong gradients, a shard left out of the loss) stays near ln(vocab) and misses by far more. A different
layout changes the order of bf16 reductions (a tp all-reduce, cp's attention merge, pp's microbatch sums), not
the arithmetic, so it falls in the same band. Rows whose group has no reference (a one-GPU row at another global
batch, as the scaling part's weak scaling) are their own reference, with their scaling against that one-GPU
row printed; a line that is not JSON (a run that failed) fails the guard; skipped rows (a CUDA-only run on
the CPU) are listed and pass.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

TOLERANCE = 0.02


def group_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["impl"], row["model"], row["seq_len"], row["global_batch"], row.get("steps"), row.get("tied"))


def label(row: dict[str, Any]) -> str:
    parts = [",".join(f"{k}={v}" for k, v in row["layout"].items())]
    for key in ("schedule", "context_attention", "dispatcher", "fp8"):
        if row.get(key):
            parts.append(str(row[key]))
    if row.get("async_tp"):
        parts.append("async_tp")
    return f"{row['impl']} {row['model']} " + " ".join(parts)


def reference_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's one-GPU bf16 row, else its first."""
    return next((r for r in rows if r["gpus"] == 1 and not r.get("fp8")), rows[0])


def compare(rows: list[dict[str, Any]], tolerance: float) -> tuple[list[str], bool]:
    """The report's lines and whether every row passes the guard."""
    lines, ok = [], True
    skipped = [r for r in rows if "skipped" in r]
    broken = [r for r in rows if "broken" in r]
    ran = [r for r in rows if "skipped" not in r and "broken" not in r]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in ran:
        groups.setdefault(group_key(row), []).append(row)
    header = (
        f"{'layout':58} {'gpus':>4} {'tok/s/GPU':>10} {'vs ref':>7} {'peak GiB':>8} {'vs ref':>7} "
        f"{'last loss':>9} {'d last':>8} {'d last10':>8}  verdict"
    )
    for key, members in groups.items():
        ref = reference_of(members)
        lines.append(f"# {key[0]} {key[1]} seq {key[2]} x {key[3]}, {key[4]} steps; reference: {label(ref)}")
        lines.append(header)
        for row in members:
            speed = row["tokens_per_s_per_gpu"] / max(ref["tokens_per_s_per_gpu"], 1)
            memory = (
                row["peak_mem_gib_max_rank"] / ref["peak_mem_gib_max_rank"]
                if ref["peak_mem_gib_max_rank"]
                else math.nan
            )
            final = row["last_loss"]
            d_last = final / ref["last_loss"] - 1
            d_mean = (
                row["loss_last10_mean"] / ref["loss_last10_mean"] - 1
                if "loss_last10_mean" in row
                else math.nan
            )
            if row is ref:
                verdict = "reference" if math.isfinite(final) else "FAIL (loss not finite)"
            elif not math.isfinite(final):
                verdict = "FAIL (loss not finite)"
            elif abs(d_last) > tolerance:
                verdict = f"FAIL (outside {tolerance:.0%})"
            else:
                verdict = "ok"
            ok &= not verdict.startswith("FAIL")
            lines.append(
                f"{label(row):58} {row['gpus']:>4} {row['tokens_per_s_per_gpu']:>10} {speed:>6.2f}x "
                f"{row['peak_mem_gib_max_rank']:>8.2f} {memory:>6.2f}x {final:>9.4f} {d_last:>+8.2%} "
                f"{d_mean:>+8.2%}  {verdict}"
            )
        if ref["gpus"] > 1:  # weak scaling (another global batch): tokens/s per GPU against one GPU's
            one = next((r for r in ran if r["gpus"] == 1 and group_key(r)[:3] == key[:3]), None)
            if one is not None:
                lines.append(
                    f"scaling: {ref['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.3f}x the one-GPU "
                    f"row's tokens/s per GPU ({ref['tokens_per_s'] / one['tokens_per_s']:.3f}x its tokens/s; "
                    f"global batch {one['global_batch']} there; no loss verdict across batches)"
                )
    for row in skipped:
        lines.append(f"skipped: {row['impl']} {row['model']}: {row['skipped']}")
    for row in broken:
        lines.append(f"FAIL (not a result line; the run failed?): {row['broken']}")
    return lines, ok and not broken


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``; a line that is not one becomes ``{"broken": line}``."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run that died left its last line of output instead
            rows.append({"broken": f"{path.name}:{number}: {line[:160]}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("jsonl", type=Path, nargs="+")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="relative final-loss band")
    args = parser.parse_args(argv)
    ok = True
    for path in args.jsonl:
        lines, passed = compare(read_rows(path), args.tolerance)
        print(f"== {path}")
        print("\n".join(lines))
        ok &= passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
