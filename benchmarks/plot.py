"""Bar charts of ``train_throughput.py`` results: tokens/s at the median step (with the ratio to the run's
baseline) and peak memory per path, one group of bars per result file (each file is one run, so ratios are only
taken inside a group). The median step, not the window's mean: one slow step (a collection, a late recompile)
in a 20-step window moves the mean by several per cent.

    python benchmarks/plot.py --out docs/benchmarks.png \\
        "dense, run A=benchmarks/results/<dir>/dense/run2.json" "MoE=benchmarks/results/<dir>/moe/run5.json"

The scale ladder (docs/ladder.png) is the same plot with one run per model size (``h200_runs.sh ladder1.7b ladder4b``):

    python benchmarks/plot.py --out docs/ladder.png "0.6B=<run>.json" "1.7B=$OUT/ladder1.7b/train_throughput.json" \\
        "4B=$OUT/ladder4b/train_throughput.json"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BASELINE = "hf_fsdp_compiled"
PEER_PREFIX = "titan_"  # another framework's paths (torchtitan bf16 and FP8), in the run as a second baseline
PEER_COLOR = "tab:orange"


def load(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """``(title, paths)``, each path with ``median_tokens_per_s`` added."""
    title, _, path = spec.partition("=")
    run = json.loads(Path(path).read_text())
    tokens_per_step = run["meta"]["tokens_per_step"]
    results = [r for r in run["results"] if r.get("ok") and r.get("tokens_per_s")]
    for r in results:
        r["median_tokens_per_s"] = tokens_per_step * 1e3 / r["step_ms"]["median"]
    return title, results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="TITLE=path/to/train_throughput.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load(spec) for spec in args.runs]
    figure, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6.5), squeeze=False)
    for column, (title, results) in enumerate(runs):
        baseline = next((r for r in results if r["path"] == BASELINE), None)
        names = [
            r["path"]
            .replace("ours_trainer_compiled", "ours")
            .replace("hf_fsdp_compiled", "baseline")
            .replace("titan_compiled", "torchtitan")
            for r in results
        ]
        colors = [
            "tab:gray"
            if r["path"] == BASELINE
            else PEER_COLOR
            if r["path"].startswith(PEER_PREFIX)
            else "tab:blue"
            for r in results
        ]
        speed, memory = axes[0][column], axes[1][column]
        bars = speed.bar(names, [r["median_tokens_per_s"] / 1e3 for r in results], color=colors)
        if baseline is not None:
            for bar, r in zip(bars, results, strict=True):
                ratio = r["median_tokens_per_s"] / baseline["median_tokens_per_s"]
                speed.annotate(
                    f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        speed.set_title(title, fontsize=10)
        speed.set_ylabel("thousand tokens/s (median step)")
        memory.bar(names, [r["peak_mem_gib"] for r in results], color=colors)
        memory.set_ylabel("peak memory, GiB")
        for axis in (speed, memory):
            axis.tick_params(axis="x", labelrotation=30, labelsize=7)
    figure.suptitle(
        "One H200: our Trainer path (blue) vs transformers + FSDP2 + per-layer torch.compile (gray) and "
        "torchtitan (orange); ratios to the gray bar",
        fontsize=10,
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
