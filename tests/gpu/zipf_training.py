"""The plain training loop the FP8 gpu tests compare recipes with: benchmarks/train_throughput.py's Zipf batches
(a distribution learnt smoothly, so runs that differ by rounding end close), bf16 autocast over fp32 weights,
fused AdamW; the losses of every step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def zipf_batches(
    vocab_size: int, *, steps: int, batch_size: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark's batches for ``steps`` steps (``inputs``, ``labels`` ``[steps, batch_size, seq_len]``)."""
    from train_throughput import _batches, parse_args

    # the benchmark's own options, so that every option its data depends on has its default here too (a
    # hand-built Namespace missed one added later, and both gpu tests that train on this data failed on it)
    options = {"--steps": steps, "--batch-size": batch_size, "--seq-len": seq_len, "--probe-steps": 0}
    args = parse_args([str(item) for pair in options.items() for item in pair])
    args.warmup = 0  # (the benchmark asks for at least one warm-up step; these runs count every step)
    inputs, labels = _batches(args, vocab_size, device)
    return inputs, labels


def train_on_zipf_batches(
    model: nn.Module, vocab_size: int, *, steps: int, lr: float, batch_size: int, seq_len: int
) -> list[float]:
    from lightning_d9d.modules.loss import causal_lm_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), fused=True)
    inputs, labels = zipf_batches(
        vocab_size, steps=steps, batch_size=batch_size, seq_len=seq_len, device=torch.device("cuda")
    )
    losses = []
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(loss) for loss in losses]
