"""The torch optimizer behind what Lightning hands a strategy."""

from __future__ import annotations

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
