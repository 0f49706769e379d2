"""Losses for language modelling."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens whose label is not ``ignore_index``.

    ``labels`` are already shifted by the caller: ``logits[:, t]`` is scored against ``labels[:, t]``. The
    softmax runs in fp32 whatever the logits' dtype (bf16 log-sum-exp over a 150k vocabulary loses too much).
    A batch with no valid label gives 0 with zero gradients instead of NaN, so a fully padded microbatch
    does not poison the step.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (labels != ignore_index).sum().clamp(min=1)
    return total / count
