"""The MoE permutation's copy on one CUDA GPU: the package's token-major copy against the gather it replaced.

    python benchmarks/permute_candidates.py [--tokens 16384 --hidden 1024 --top-k 8 --experts 64]

A profile of the MoE benchmark shape on one H100 (``benchmarks/profile_step.py``) shows the permutation's gather
(grouped row ``r`` reads token ``order[r] // k``) at about half the copy bandwidth. The token-major copy
(``lightning_d9d.kernels.permute_triton.spread_rows``) reads each token's row once and writes it to its ``k``
grouped rows (``inverse``; every row written once, no atomics). It is the faster of the two at the MoE shape
(this script's table), so the package takes it; the gather stays here as the baseline, with the copy's tile sizes
the package did not pick. Both must produce the same rows bit for bit.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from lightning_d9d.kernels.permute import group_by_expert
from lightning_d9d.kernels.permute_triton import _spread_rows, spread_rows


@triton.jit
def _gather_rows(  # type: ignore[no-untyped-def]
    SRC, IDX, DST, rows, hidden, ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = row < rows
    source = tl.load(IDX + row, mask=row_mask, other=0).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        values = tl.load(SRC + source[:, None] * hidden + cols[None, :], mask=mask)
        tl.store(DST + row[:, None] * hidden + cols[None, :], values, mask=mask)


def gather(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` with the tile of the package's former gather (4 rows of up to 1024 a program)."""
    out = torch.empty((index.numel(), source.shape[1]), dtype=source.dtype, device=source.device)
    block = max(16, min(1024, triton.next_power_of_2(source.shape[1])))
    _gather_rows[(triton.cdiv(index.numel(), 4),)](
        source, index, out, index.numel(), source.shape[1], 4, block, num_warps=8 if 4 * block >= 4096 else 4
    )
    return out


def spread(source: torch.Tensor, inverse: torch.Tensor, top_k: int, rows: int, warps: int) -> torch.Tensor:
    tokens, hidden = source.shape
    out = torch.empty((tokens * top_k, hidden), dtype=source.dtype, device=source.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _spread_rows[(triton.cdiv(tokens, rows),)](
        source, inverse, out, tokens, hidden, top_k, rows, block, num_warps=warps
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    indices = torch.rand(args.tokens, args.experts, device="cuda").topk(args.top_k, dim=1).indices
    order, inverse = group_by_expert(indices.reshape(-1), args.experts)
    sources = torch.div(order, args.top_k, rounding_mode="floor")
    expected = x[sources]
    written = expected.numel() * expected.element_size()
    variants = {
        "gather (the former kernel)": lambda: gather(x, sources),
        "token-major (the package's)": lambda: spread_rows(x, inverse, args.top_k),
    }
    for rows, warps in [(1, 4), (2, 4), (2, 8), (4, 8)]:
        variants[f"token-major, {rows} token(s) a program, {warps} warps"] = partial_spread(
            x, inverse, args.top_k, rows, warps
        )
    for name, run in variants.items():
        assert torch.equal(run(), expected), name
        microseconds = do_bench(run) * 1e3
        row = {
            "impl": name,
            "us": round(microseconds, 1),
            "write_TBs": round(written / microseconds / 1e6, 2),
        }
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        )
    )


def partial_spread(x: torch.Tensor, inverse: torch.Tensor, top_k: int, rows: int, warps: int):  # type: ignore[no-untyped-def]
    return lambda: spread(x, inverse, top_k, rows, warps)


if __name__ == "__main__":
    main()
