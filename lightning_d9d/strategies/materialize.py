"""Giving meta tensors their memory without touching torchmetrics metrics."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import Metric


def to_empty_except_metrics(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` for every submodule except torchmetrics metrics.

    A ``Metric`` applies ``to_empty`` to its states and to their defaults as well (its ``_apply``), which leaves
    them uninitialised memory: a metric built in the LightningModule's ``__init__`` then accumulates onto
    garbage and ``reset()`` restores garbage (a perplexity read back as ``inf``). Metrics hold no meta tensors,
    so they have nothing to gain from it.
    """
    if isinstance(module, Metric):
        return
    module.to_empty(device=device, recurse=False)
    for child in module.children():
        to_empty_except_metrics(child, device)
