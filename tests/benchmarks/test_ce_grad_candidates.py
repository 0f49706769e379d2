"""``ce_grad_candidates.py``'s persistent softmax-gradient pass: a program looping over rows computes what the
package's one-program-a-row kernel computes, bit for bit (Triton's interpreter on CPU), with fewer programs than
rows, a ragged last block of the vocabulary and ignored labels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_d9d.kernels.dispatch import interpreting
from lightning_d9d.kernels.linear_cross_entropy import softmax_cross_entropy_grad_

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ce_grad_candidates import persistent


@pytest.mark.parametrize("programs", [1, 3, 16])
def test_the_persistent_pass_equals_the_package_s_bit_for_bit(programs: int) -> None:
    assert (
        interpreting() or torch.cuda.is_available()
    )  # the root conftest turns the interpreter on without a GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 7, 300  # block 256 on the candidate's side: two blocks, the second ragged
    logits = (torch.randn(rows, vocab, generator=generator) * 4).bfloat16().to(device)
    labels = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    labels[2] = -100
    scale = torch.tensor(0.25, device=device)
    expected, candidate = logits.clone(), logits.clone()
    expected_losses = softmax_cross_entropy_grad_(expected, labels, scale, -100)
    losses = persistent(candidate, labels, scale, -100, programs, block=256, warps=4)
    assert not torch.equal(candidate, logits)  # the gradient was written over the logits
    assert torch.equal(losses, expected_losses) and torch.equal(candidate, expected)
    assert float(losses[2]) == 0.0 and not bool(candidate[2].any())
