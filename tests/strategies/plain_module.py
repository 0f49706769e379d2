"""A LightningModule written for plain PyTorch: no meta device, no parallelize(), built in ``__init__``."""

from __future__ import annotations

import os

import torch
from torch import nn


class PlainCausalLM(nn.Module):
    def __init__(self, vocab_size: int, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


def build_plain_model(vocab_size: int, *, rank: int | None = None) -> PlainCausalLM:
    """Every rank seeds differently on purpose: the strategy must make rank 0's initialisation win."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) if rank is None else rank
    with torch.random.fork_rng():
        torch.manual_seed(1000 + rank)
        return PlainCausalLM(vocab_size)
