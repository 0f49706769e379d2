"""How evenly context parallelism's head-and-tail split shares the attention work of packed rows (CPU, seconds).

    PYTHONPATH=. python benchmarks/packed_cp_balance.py [--rows 512 --median 500 --sigma 1.0 --out balance.json]

Documents of lognormal length (median ``--median`` tokens, log-sd ``--sigma``; longer than a row: cut at the row)
are packed into rows of 4096 and 8192 tokens by :func:`lightning_d9d.data.pack_documents` (a document that does
not fit the rest of a row continues in the next one). For cp = 2, 4, 8 each rank's work is the number of (query,
key) pairs its queries attend under the document mask
(:func:`~lightning_d9d.modules.context_attention.context_attention_work`): the work of a kernel that skips masked
pairs. Reported per row length and cp: max / mean over the ranks of that work, for one row per step (the mean,
95th percentile and worst over the rows) and for 8 rows per step (work summed over them, as a rank does), for
the head-and-tail split and, beside it, a contiguous split (rank r holds the r-th T / cp tokens) and the
per-document head-and-tail split of varlen context parallelism (each document cut into 2cp chunks of its own; not
built, measured as the fix); and the case of one document per row (plain causal), where the head-and-tail split
is exactly even.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from lightning_d9d.data import pack_documents
from lightning_d9d.modules.context_attention import LoadBalancedSplit, context_attention_work
from lightning_d9d.modules.documents import attended_keys

ROW_LENGTHS = (4096, 8192)
CP = (2, 4, 8)
ROWS_PER_STEP = 8


def lognormal_lengths(count: int, median: float, sigma: float, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    return [max(2, round(value)) for value in (math.log(median) + sigma * normal).exp().tolist()]


def packed_positions(lengths: list[int], row_length: int, rows: int) -> torch.Tensor:
    """``[rows, row_length]`` positions of the documents packed in order (tokens are irrelevant: zeros)."""
    packed = []
    documents = (torch.zeros(n, dtype=torch.long) for n in lengths)
    for row in pack_documents(documents, row_length):
        packed.append(row["position_ids"])
        if len(packed) == rows:
            return torch.stack(packed)
    raise ValueError(f"{len(lengths)} documents fill only {len(packed)} rows of {row_length}; ask for more")


def contiguous_work(position_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """``[cp]``: the attended pairs of each rank when rank r holds the r-th ``T / cp`` tokens (no balancing)."""
    per_query = attended_keys(position_ids).sum(0)
    return per_query.view(cp, -1).sum(-1)


def per_document_work(position_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """``[cp]``: the attended pairs of each rank if every document were cut into ``2 * cp`` chunks of its own
    (``ceil(n / 2cp)`` tokens, the last ones shorter) and rank r held chunks r and ``2cp - 1 - r`` of each (the
    per-document head-and-tail layout of varlen context parallelism, not built here: the fix this measures)."""
    keys = attended_keys(position_ids)  # a token's index in its document, plus one
    documents = position_ids.new_zeros(position_ids.shape)
    documents[:, 1:] = (keys[:, 1:] == 1).cumsum(-1)  # a new document wherever one starts (keys back to 1)
    flat = (documents + torch.arange(position_ids.shape[0])[:, None] * position_ids.shape[1]).flatten()
    lengths = torch.bincount(flat)[flat]  # each token's document length
    chunk = (lengths + 2 * cp - 1) // (2 * cp)
    index = (keys.flatten() - 1) // chunk  # which of its document's 2cp chunks
    rank = torch.where(index < cp, index, 2 * cp - 1 - index)
    return torch.bincount(rank, weights=keys.flatten().double(), minlength=cp)


def imbalance(work: torch.Tensor) -> float:
    """max / mean over the ranks (1.0: even)."""
    work = work.double()
    return float(work.max() / work.mean())


def summary(ratios: list[float]) -> dict[str, float]:
    values = torch.tensor(ratios, dtype=torch.float64)
    return {
        "mean": round(float(values.mean()), 4),
        "p95": round(float(values.quantile(0.95)), 4),
        "max": round(float(values.max()), 4),
    }


def measure(positions: torch.Tensor, cp: int) -> dict[str, Any]:
    split = LoadBalancedSplit(cp, 0)
    per_row = [imbalance(context_attention_work(row[None], split)) for row in positions]
    per_row_contiguous = [imbalance(contiguous_work(row[None], cp)) for row in positions]
    steps = positions.split(ROWS_PER_STEP)
    per_step = [imbalance(context_attention_work(step, split)) for step in steps]
    per_step_contiguous = [imbalance(contiguous_work(step, cp)) for step in steps]
    per_row_documents = [imbalance(per_document_work(row[None], cp)) for row in positions]
    per_step_documents = [imbalance(per_document_work(step, cp)) for step in steps]
    return {
        "per_document": {
            "one_row": summary(per_row_documents),
            f"{ROWS_PER_STEP}_rows": summary(per_step_documents),
        },
        "head_and_tail": {"one_row": summary(per_row), f"{ROWS_PER_STEP}_rows": summary(per_step)},
        "contiguous": {
            "one_row": summary(per_row_contiguous),
            f"{ROWS_PER_STEP}_rows": summary(per_step_contiguous),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="rows measured per row length")
    parser.add_argument("--median", type=float, default=500.0, help="median document length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-sd of the document lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    results: dict[str, Any] = {"median": args.median, "sigma": args.sigma, "rows": args.rows}
    for row_length in ROW_LENGTHS:
        # enough documents for the rows: their mean length is median * exp(sigma^2 / 2), cut at the row
        count = int(args.rows * row_length / args.median * 2) + 100
        lengths = lognormal_lengths(count, args.median, args.sigma, args.seed)
        positions = packed_positions(lengths, row_length, args.rows)
        starts = int((positions == 0).sum())
        for cp in CP:
            key = f"T={row_length} cp={cp}"
            results[key] = measure(positions, cp)
            results[key]["documents_per_row"] = round(starts / args.rows, 2)
            one_document = torch.arange(row_length)[None]
            results[key]["one_document"] = round(
                imbalance(context_attention_work(one_document, LoadBalancedSplit(cp, 0))), 6
            )
            line = [f"{key}: {results[key]['documents_per_row']} documents/row; max/mean work"]
            for layout in ("head_and_tail", "contiguous", "per_document"):
                one, several = results[key][layout]["one_row"], results[key][layout][f"{ROWS_PER_STEP}_rows"]
                line.append(
                    f"{layout}: row mean {one['mean']} p95 {one['p95']} worst {one['max']}, "
                    f"{ROWS_PER_STEP} rows mean {several['mean']} worst {several['max']}"
                )
            line.append(f"one document {results[key]['one_document']}")
            print(" | ".join(line), flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
