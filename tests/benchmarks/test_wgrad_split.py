"""``grouped_wgrad_balance.py``'s split weight gradient: each expert's tokens cut into consecutive pieces, one
product per piece, the pieces of an expert summed, is the expert's whole product (empty experts included)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grouped_wgrad_balance import split_ends


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_pieces_of_each_expert_sum_to_its_weight_gradient(pieces: int) -> None:
    sizes = torch.tensor([5, 0, 3, 8, 1])
    generator = torch.Generator().manual_seed(0)
    x, dy = torch.randn(17, 4, generator=generator), torch.randn(17, 3, generator=generator)
    ends = split_ends(sizes, pieces)
    assert ends.shape == (len(sizes) * pieces,) and int(ends[-1]) == int(sizes.sum())
    assert bool((ends.diff() >= 0).all())
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    parts = torch.stack([x[a:b].t() @ dy[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    whole = torch.stack([x[a:b].t() @ dy[a:b] for a, b in itertools.pairwise(bounds)])
    torch.testing.assert_close(parts.view(len(sizes), pieces, 4, 3).sum(1), whole)
