"""lightning_d9d: d9d-style composable N-D parallel LLM training for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="d9d")`` in Lightning's strategy registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.strategies import D9DPrecision, D9DStrategy, model_loss

D9DStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["D9DPrecision", "D9DStrategy", "ParallelDims", "ParallelOptions", "__version__", "model_loss"]
