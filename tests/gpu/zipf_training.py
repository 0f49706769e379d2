"""The plain training loop the FP8 gpu tests compare recipes with: benchmarks/train_throughput.py's Zipf batches
(a distribution learnt smoothly, so runs that differ by rounding end close), bf16 autocast over fp32 weights,
fused AdamW; the losses of every step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def train_on_zipf_batches(
    model: nn.Module, vocab_size: int, *, steps: int, lr: float, batch_size: int, seq_len: int
) -> list[float]:
    from train_throughput import _batches

    from lightning_d9d.modules.loss import causal_lm_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), fused=True)
    args = argparse.Namespace(warmup=0, steps=steps, probe_steps=0, batch_size=batch_size, seq_len=seq_len)
    inputs, labels = _batches(args, vocab_size, torch.device("cuda"))
    losses = []
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(loss) for loss in losses]
