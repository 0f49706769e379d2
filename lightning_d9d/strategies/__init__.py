"""Lightning glue: the strategy, its precision plugin and gradient clipping."""

from lightning_d9d.strategies.d9d import D9DStrategy
from lightning_d9d.strategies.loss import model_loss
from lightning_d9d.strategies.precision import D9DPrecision

__all__ = ["D9DPrecision", "D9DStrategy", "model_loss"]
