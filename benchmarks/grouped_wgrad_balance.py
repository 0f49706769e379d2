"""The experts' weight-gradient grouped GEMM on one CUDA GPU, by how evenly the tokens spread over the experts.

    python benchmarks/grouped_wgrad_balance.py [--tokens 16384 --top-k 8 --experts 64 --hidden 1024 --ffn 384]

Profiles of the MoE benchmark shape on one H100 (``benchmarks/profile_step.py``): the weight-gradient grouped GEMM
(``dW_e = X_e^T dY_e``, the tokens the contraction) takes longer a call in the Trainer run on the benchmark's
Zipf-drawn tokens than in the plain loop on uniformly drawn tokens; the other two grouped GEMMs take the same time
in both.
Each expert's output tiles cost in proportion to its tokens, so an expert with many tokens keeps its tiles'
programs busy after the rest are done. This times torch's ``_grouped_mm`` as autograd calls it for the weight
gradient, at even group sizes and at sizes routed from Zipf-drawn tokens (each vocabulary id sent to a fixed
random top-k set of experts: routing by the token alone, as a fresh router roughly does), and the forward's
product at the same sizes for comparison; and two made-up spreads, a ramp (0 to twice the mean) and 8 experts at
three times the mean. On an H100 (docs/benchmarks.md, run U7's raw results): 319 us even, 355-367 us at the
uneven sizes for gate_up.

The lever it prices (measured and dropped, docs/benchmarks.md, run U7: 582-597 us at 2 pieces and 644-663 us at 4
against 319-367 us unsplit for gate_up): split every expert's tokens into ``--splits`` consecutive pieces,
run the weight-gradient GEMM over ``experts x splits`` groups (shorter contractions, the heavy expert's work
spread over more programs) and sum each expert's pieces (``wgrad_split{S}_us``, the sum included; ``split{S}_err``:
its error against an fp32 reference, beside the unsplit GEMM's ``err``: the pieces are rounded to bf16 before the
sum).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench


def zipf_sizes(tokens: int, top_k: int, experts: int, vocab: int = 151936) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    ranks = torch.randperm(vocab, generator=generator)
    weights = torch.empty(vocab)
    weights[ranks] = 1.0 / (torch.arange(vocab, dtype=torch.float32) + 10.0)
    ids = torch.multinomial(weights, tokens, True, generator=generator)
    choice = torch.rand(vocab, experts, generator=generator).topk(top_k, dim=1).indices
    return torch.bincount(choice[ids].reshape(-1), minlength=experts)


def split_ends(sizes: torch.Tensor, pieces: int) -> torch.Tensor:
    """Group ends of every group cut into ``pieces`` consecutive parts (empty ones allowed), ``[G * pieces]``."""
    starts = torch.cumsum(sizes, 0) - sizes
    parts = torch.arange(1, pieces + 1, device=sizes.device)
    return (starts[:, None] + sizes[:, None] * parts // pieces).reshape(-1)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).norm() / reference.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=384)
    parser.add_argument("--splits", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    rows = args.tokens * args.top_k
    even = torch.full((args.experts,), rows // args.experts)
    routed = zipf_sizes(args.tokens, args.top_k, args.experts)
    mean = rows // args.experts
    # a linear ramp from 0 to twice the mean, and 8 hot experts at three times it (the rest share what is left)
    ramp = torch.linspace(0, 2 * mean, args.experts).round().long()
    ramp[-1] += rows - int(ramp.sum())
    hot = torch.full((args.experts,), (rows - 8 * 3 * mean) // (args.experts - 8))
    hot[:8] = 3 * mean
    hot[-1] += rows - int(hot.sum())
    for name, sizes in (("even", even), ("zipf-routed", routed), ("ramp", ramp), ("8 hot", hot)):
        ends = torch.cumsum(sizes, 0).to(device="cuda", dtype=torch.int32)
        stats = {"max/mean": round(float(sizes.max()) / (rows / args.experts), 2), "min": int(sizes.min())}
        for label, k, n in (("gate_up", args.hidden, 2 * args.ffn), ("down", args.ffn, args.hidden)):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(args.experts, k, n, device="cuda", dtype=torch.bfloat16)
            wgrad_ms = do_bench(lambda x=x, dy=dy, ends=ends: torch._grouped_mm(x.t(), dy, offs=ends))
            forward_ms = do_bench(lambda x=x, w=w, ends=ends: torch._grouped_mm(x, w, offs=ends))
            flops = 2 * rows * k * n
            bounds = [0, *torch.cumsum(sizes, 0).tolist()]
            reference = torch.stack(
                [x[a:b].t().float() @ dy[a:b].float() for a, b in itertools.pairwise(bounds)]
            )
            row = {
                "sizes": name,
                **stats,
                "gemm": label,
                "wgrad_us": round(wgrad_ms * 1e3, 1),
                "wgrad_TFLOPs": round(flops / wgrad_ms / 1e9, 1),
                "forward_us": round(forward_ms * 1e3, 1),
                "err": f"{relative_error(torch._grouped_mm(x.t(), dy, offs=ends), reference):.2e}",
            }
            for pieces in args.splits:
                cut = split_ends(sizes.cuda(), pieces).to(torch.int32)

                def split_wgrad(
                    x: torch.Tensor = x, dy: torch.Tensor = dy, cut: torch.Tensor = cut
                ) -> torch.Tensor:
                    parts = torch._grouped_mm(x.t(), dy, offs=cut)
                    return parts.view(args.experts, -1, *parts.shape[1:]).sum(1)

                row[f"wgrad_split{pieces}_us"] = round(do_bench(split_wgrad) * 1e3, 1)
                row[f"split{pieces}_err"] = f"{relative_error(split_wgrad(), reference):.2e}"
            print(json.dumps(row))
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
