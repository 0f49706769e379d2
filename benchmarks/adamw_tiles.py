"""The master-weight AdamW kernel's tile on one CUDA GPU: elements a program and warps, at one large tensor.

    PYTHONPATH=. python benchmarks/adamw_tiles.py [--numel 268435456]

``MasterWeightAdamW``'s Triton pass (``lightning_d9d.kernels.adamw``) moves 28 bytes an element (reads fp32
master, moments and a bf16 gradient; writes them and the bf16 copy). Timed inside the optimizer step
(``master_weights_speed.py``) it reaches about the same rate on an H100 and an H200, cards of 3.35 and 4.8 TB/s,
which asks whether the pass is at the bandwidth. This times the kernel alone at each tile (CUDA-event median of
``triton.testing.do_bench``), the package's first, beside a plain copy of the same bytes; a faster tile belongs in
``kernels/adamw.py``. On an H100 (docs/benchmarks.md, run U11): the copy 3.05 TB/s, the kernel 3.02 at every tile
from 1024 to 8192 elements a program (16,384: 2.63, in the run's raw results), so there it is at the bandwidth;
the H200 has no such run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from lightning_d9d.kernels import adamw

TILES = [(adamw.BLOCK, 8), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (8192, 8), (8192, 16), (16384, 16)]


def _copy_ms(nbytes: int) -> float:
    source = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    return float(do_bench(lambda: target.copy_(source)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 28)
    args = parser.parse_args()
    n = args.numel
    master, exp_avg, exp_avg_sq = (torch.randn(n, device="cuda") for _ in range(3))
    exp_avg_sq.abs_()
    grad, param = (
        torch.randn(n, device="cuda", dtype=torch.bfloat16),
        torch.empty(n, device="cuda").bfloat16(),
    )
    # What this card's memory moves at all, the same 28 bytes an element: torch's copy of the bytes (a read and a
    # write of 14 per element), the ceiling a streaming pass can reach.
    copy_ms = _copy_ms(14 * n)
    print(
        json.dumps(
            {"copy_14B_each_way": True, "ms": round(copy_ms, 3), "TBs": round(28 * n / copy_ms / 1e9, 2)}
        )
    )
    for block, warps in TILES:

        def step(block: int = block, warps: int = warps) -> None:
            adamw._adamw_master_step[(triton.cdiv(n, block),)](
                master, grad, exp_avg, exp_avg_sq, param, master, n,
                0.1, 0.999, 0.001, 1e-8, 0.9999, 1e-4, 0.5, False, block, num_warps=warps,
            )  # fmt: skip

        ms = do_bench(step)
        print(
            json.dumps(
                {"block": block, "warps": warps, "ms": round(ms, 3), "TBs": round(28 * n / ms / 1e9, 2)}
            )
        )
    print(
        json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        )
    )


if __name__ == "__main__":
    main()
