"""lightning_d9d: d9d-style composable N-D parallel LLM training for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="d9d")`` in Lightning's strategy registry.
"""

from lightning_d9d.compat import check_versions

# First: an untested torch / Lightning is named (warning), or a missing private name (error), before anything
# that depends on them is imported.
check_versions()

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_d9d.mesh import ParallelDims  # noqa: E402
from lightning_d9d.plans import ParallelOptions  # noqa: E402
from lightning_d9d.strategies import D9DPrecision, D9DStrategy, model_loss  # noqa: E402

D9DStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["D9DPrecision", "D9DStrategy", "ParallelDims", "ParallelOptions", "__version__", "model_loss"]
