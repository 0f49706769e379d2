"""The fused loss's softmax-gradient pass on one CUDA GPU: the package's kernel against a persistent candidate.

    python benchmarks/ce_grad_candidates.py [--rows 2048 --vocab 151936]

``lightning_d9d.kernels.linear_cross_entropy._softmax_ce_grad_kernel`` runs one program per row of a chunk's
logits and reads the row twice (its log-sum-exp, then the gradient written over it): three passes over the
chunk. Session 32's profile (one H100, the MoE shape): 657 us a chunk of 2048 x 151,936 bf16 logits, 5.3 ms a
step, ~2.8 TB/s for the three passes. A row is 297 KiB: with one program per SM looping over rows (the
candidate), the rows in flight take ~40 MB, under the H100's 50 MB L2, so the second read could come from L2
and the pass cost two passes of memory instead of three (~1.9 ms a step at the MoE and 0.6B shapes, if it
does). With one program per row as many rows are in flight as the SMs hold programs, several times more.

Same arithmetic per row in the same order: the candidate's losses and gradients must equal the package's bit for
bit at the package's block (``tests/benchmarks/test_ce_grad_candidates.py`` checks it in Triton's interpreter;
at a block of 8192 the sums run in another order, so ``equal`` is false there).

Measured (session 32, one H100, 2048 x 151,936): the package 0.649 ms (2.88 TB/s counted as three passes); the
candidate 1.63 / 0.98 / 0.72 ms at 1 / 2 / 4 programs an SM (block 4096, 8 warps), 0.97 / 0.73 / 0.72 ms at block
8192 and 16 warps: slower at every tile. Fewer programs in flight cost more bandwidth than the L2 gives back, so
the package keeps one program a row. (Raw: ``benchmarks/results/2026-12-06-h100-session32/ce_grad/``.)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from lightning_d9d.kernels.dispatch import launchable
from lightning_d9d.kernels.linear_cross_entropy import softmax_cross_entropy_grad_
from lightning_d9d.kernels.triton_compat import tl, triton


@triton.jit
def _softmax_ce_grad_persistent(  # type: ignore[no-untyped-def]
    LOGITS, LABELS, SCALE, LOSSES, rows, vocab, stride, ignore_index, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    # The package's kernel, a program looping over rows program_id, program_id + programs, ...
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        base = LOGITS + tl.cast(row, tl.int64) * stride
        label = tl.load(LABELS + row)
        keep = label != ignore_index
        running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - safe) + tl.exp(x - safe)
            running_max = new_max
        top = tl.max(running_max, axis=0)
        lse = top + tl.log(tl.sum(running_sum * tl.exp(running_max - top), axis=0))
        target = tl.where(keep, label, 0)
        picked = tl.load(base + target).to(tl.float32)
        tl.store(LOSSES + row, tl.where(keep, lse - picked, 0.0))
        scale = tl.where(keep, tl.load(SCALE), 0.0)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def persistent(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    programs: int,
    block: int = 4096,
    warps: int = 8,
) -> torch.Tensor:
    """The candidate on ``programs`` programs: per-row losses, the logits overwritten by their gradient."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    kernel = launchable(_softmax_ce_grad_persistent, logits.device)
    kernel[(min(rows, programs),)](
        logits, labels.contiguous(), scale.reshape(1).float(), losses, rows, vocab, logits.stride(0),
        ignore_index, min(block, triton.next_power_of_2(vocab)), num_warps=warps,
    )  # fmt: skip
    return losses


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    torch.manual_seed(0)
    source = torch.randn(args.rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    labels[::7] = -100
    scale = torch.tensor(1.0 / args.rows, device="cuda")
    nbytes = 3 * source.numel() * source.element_size()  # two reads and a write of the logits
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    reference = source.clone()
    reference_losses = softmax_cross_entropy_grad_(reference, labels, scale, -100)
    work = source.clone()

    def report(name: str, run: Callable[[], object], equal: bool) -> None:
        # in place on gradients after the first call: other values, the same bytes moved
        ms = do_bench(run, warmup=5, rep=50)
        print(
            json.dumps(
                {"kernel": name, "ms": round(ms, 4), "TBs": round(nbytes / ms / 1e9, 2), "equal": equal}
            )
        )

    report(
        "package (one program a row)", lambda: softmax_cross_entropy_grad_(work, labels, scale, -100), True
    )
    for per_sm in (1, 2, 4):
        for block, warps in ((4096, 8), (8192, 16)):
            programs = sms * per_sm
            work.copy_(source)
            losses = persistent(work, labels, scale, -100, programs, block, warps)
            equal = bool(torch.equal(losses, reference_losses) and torch.equal(work, reference))
            report(
                f"persistent {per_sm}/SM block {block} warps {warps}",
                lambda programs=programs, block=block, warps=warps: persistent(
                    work, labels, scale, -100, programs, block, warps
                ),
                equal,
            )
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__,
                      "triton": triton.__version__}))  # fmt: skip


if __name__ == "__main__":
    main()
