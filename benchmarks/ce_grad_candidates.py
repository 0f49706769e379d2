"""The fused loss's softmax-gradient pass on one CUDA GPU: the package's kernel against orders that re-read from L2.

    python benchmarks/ce_grad_candidates.py [--tokens 2048 --vocab 151936]

``softmax_cross_entropy_grad_`` reads a row of bf16 logits twice (the log-sum-exp, then the gradient) and
writes it once: 3 x 2 bytes an element. Session 26's profile (one H100, the MoE shape) timed it at 657 us a
2048-token chunk, ~2.8 TB/s over those bytes, 5.3 ms a step. A 151,936-wide bf16 row is 304 KB: with one
program a row and hundreds of rows in flight, the first pass's bytes have left the 50 MB L2 before the second
pass reads them. Two ways to read them back from L2 instead of memory, timed here beside the package's:

- ``reverse``: the second pass walks the row from its end, so it starts on the blocks read last;
- ``persistent``: ``SMs x k`` programs loop over the rows, so only that many rows are in flight.

Every variant must write the same gradient and losses bit for bit (the arithmetic is the same; only the order
in which blocks are visited differs). Session 27 (H100): the package's 646 us, reversed 706, persistent 714-1,656:
neither brings the second read back from L2, and the package's kernel stays.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from lightning_d9d.kernels.linear_cross_entropy import softmax_cross_entropy_grad_


@triton.jit
def _ce_grad_ordered(  # type: ignore[no-untyped-def]
    LOGITS, LABELS, SCALE, LOSSES, rows, vocab, stride, ignore_index,
    REVERSE: tl.constexpr, BLOCK: tl.constexpr,
):  # pragma: no cover - compiled by Triton  # fmt: skip
    blocks = tl.cdiv(vocab, BLOCK)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        base = (
            LOGITS + (row + tl.full([], 0, tl.int64)) * stride
        )  # 64-bit offsets (the interpreter's row: an int)
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
        for i in range(0, blocks):
            block = blocks - 1 - i if REVERSE else i
            cols = block * BLOCK + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def ordered(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, programs: int, reverse: bool, warps: int
) -> torch.Tensor:
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _ce_grad_ordered[(min(rows, programs),)](
        logits, labels, scale, losses, rows, vocab, logits.stride(0), -100, reverse, 4096, num_warps=warps
    )
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    torch.manual_seed(0)
    source = torch.randn(args.tokens, args.vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    labels[::7] = -100
    scale = torch.tensor(1.0 / args.tokens, device="cuda")
    work = source.clone()
    expected_losses = softmax_cross_entropy_grad_(work, labels, scale, -100)
    expected = work.clone()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {
        "the package's (a program a row)": lambda w: softmax_cross_entropy_grad_(w, labels, scale, -100)
    }
    for programs, reverse, warps in [
        (args.tokens, True, 8),
        (sms, False, 8),
        (sms, True, 8),
        (sms, True, 16),
        (2 * sms, True, 8),
        (4 * sms, True, 8),
    ]:
        name = f"{'reverse' if reverse else 'forward'} pass 2, {programs} programs, {warps} warps"
        variants[name] = lambda w, p=programs, r=reverse, n=warps: ordered(
            w, labels, scale.reshape(1), p, r, n
        )
    moved = 3 * source.numel() * source.element_size()
    for name, run in variants.items():
        work.copy_(source)
        losses = run(work)
        same = bool(torch.equal(work, expected) and torch.equal(losses, expected_losses))
        # each timed call overwrites its input with the gradient: time it on a fresh copy every time, and take
        # the copy's own time off
        copy_ms = do_bench(lambda: work.copy_(source))
        ms = do_bench(lambda run=run: (work.copy_(source), run(work))) - copy_ms
        print(
            json.dumps(
                {"variant": name, "us": round(ms * 1e3, 1), "TBs": round(moved / ms / 1e9, 2), "same": same}
            )
        )
    print(
        json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        )
    )


if __name__ == "__main__":
    main()
