"""lightning_d9d: d9d-style composable N-D parallel LLM training for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="d9d")`` and ``Fabric(strategy="d9d")`` in Lightning's two
strategy registries, without importing Lightning itself: importing Lightning takes seconds, and ``python -m
lightning_d9d.convert`` needs none of it. A registry that exists already gets the name now; otherwise it gets it
the moment Lightning creates it (an import hook), which is before any ``Trainer`` or ``Fabric`` can look the name
up. The public names (``D9DStrategy``, ...) load on first access (PEP 562).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_d9d.fabric import D9DFabricStrategy
    from lightning_d9d.mesh import ParallelDims
    from lightning_d9d.modules.metrics import CausalLMPerplexity, TokenAccuracy
    from lightning_d9d.optim import Muon, StochasticAdamW
    from lightning_d9d.plans import LoRA, ParallelOptions
    from lightning_d9d.strategies import D9DPrecision, D9DStrategy, model_loss

__version__ = "0.1.0"
__all__ = [
    "CausalLMPerplexity",
    "D9DFabricStrategy",
    "D9DPrecision",
    "D9DStrategy",
    "LoRA",
    "Muon",
    "ParallelDims",
    "ParallelOptions",
    "StochasticAdamW",
    "TokenAccuracy",
    "__version__",
    "model_loss",
]

STRATEGY_NAME = "d9d"
_PUBLIC = {
    "D9DFabricStrategy": "lightning_d9d.fabric",
    "D9DPrecision": "lightning_d9d.strategies",
    "D9DStrategy": "lightning_d9d.strategies",
    "model_loss": "lightning_d9d.strategies",
    "ParallelDims": "lightning_d9d.mesh",
    "ParallelOptions": "lightning_d9d.plans",
    "LoRA": "lightning_d9d.plans",
    "Muon": "lightning_d9d.optim",  # Lightning: loaded on first access only
    "StochasticAdamW": "lightning_d9d.optim",
    "CausalLMPerplexity": "lightning_d9d.modules.metrics",  # torchmetrics: loaded on first access only
    "TokenAccuracy": "lightning_d9d.modules.metrics",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_d9d' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _d9d_strategy(**init_params: Any) -> D9DStrategy:
    """What ``Trainer(strategy="d9d")`` calls: the strategy class is imported only then, because the registry
    is created while Lightning's own package is still half imported (the strategy's imports need all of it)."""
    from lightning_d9d.strategies import D9DStrategy

    return D9DStrategy(**init_params)


def _d9d_fabric_strategy(**init_params: Any) -> D9DFabricStrategy:
    """What ``Fabric(strategy="d9d")`` calls (imported then, as for the Trainer's)."""
    from lightning_d9d.fabric import D9DFabricStrategy

    return D9DFabricStrategy(**init_params)


def _register_trainer_strategy(registry_module: ModuleType) -> None:
    registry = registry_module.StrategyRegistry
    if STRATEGY_NAME not in registry:  # importing twice must not fail
        registry.register(STRATEGY_NAME, _d9d_strategy, description="d9d N-D parallel training")


def _register_fabric_strategy(registry_module: ModuleType) -> None:
    registry = registry_module.STRATEGY_REGISTRY
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, _d9d_fabric_strategy, description="d9d N-D parallel training")


# where Lightning creates each strategy registry, and how the name goes in
_REGISTRIES: dict[str, Callable[[ModuleType], None]] = {
    "lightning.pytorch.strategies": _register_trainer_strategy,
    "lightning.fabric.strategies": _register_fabric_strategy,
}


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """An import hook that registers the name right after a registry module of Lightning executes."""

    def __init__(self, pending: dict[str, Callable[[ModuleType], None]]) -> None:
        self.pending = pending

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        register = self.pending.pop(fullname, None)
        if register is None:
            return None
        if not self.pending:  # every registry seen: the other finders locate modules as usual
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            register(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    pending = {}
    for name, register in _REGISTRIES.items():
        if name in sys.modules:
            register(sys.modules[name])
        else:
            pending[name] = register
    if pending and not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads(pending))


_install()
