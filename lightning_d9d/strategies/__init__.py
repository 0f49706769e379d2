"""Lightning glue: the strategy, its precision plugin and gradient clipping, the non-finite guard."""

from lightning_d9d.strategies.d9d import D9DStrategy
from lightning_d9d.strategies.guards import NonFiniteError, NonFiniteGuard
from lightning_d9d.strategies.loss import model_loss
from lightning_d9d.strategies.precision import D9DPrecision

__all__ = ["D9DPrecision", "D9DStrategy", "NonFiniteError", "NonFiniteGuard", "model_loss"]
