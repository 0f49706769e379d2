"""What the two d9d strategies share (``D9DStrategy`` for the Trainer, ``D9DFabricStrategy`` for Fabric): the
registry name, the degrees and the mesh (:class:`~lightning_d9d.strategies.topology.MeshTopology`), and which
modules are parallel already. Each strategy adds only its Lightning or Fabric edge."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_d9d.pipeline import PipelineRunner
from lightning_d9d.strategies.topology import MeshTopology

# Every module a d9d strategy made parallel, with its pipeline runner (None without pp). Beside the module, not on
# it (no attributes of ours in the user's module), and for the process, not one strategy: a later fit or validate
# of the same module (a new Trainer brings a new strategy) finds it parallel and reuses its runner. Weak: an entry
# goes with its module.
_PARALLELIZED: weakref.WeakKeyDictionary[nn.Module, PipelineRunner | None] = weakref.WeakKeyDictionary()


class StrategyRegistryType(Protocol):
    """What ``register_strategies`` uses of the registry Lightning or Fabric hands it (a dict of names)."""

    def __contains__(self, name: object, /) -> bool: ...

    def register(
        self,
        name: str,
        strategy: Callable[..., Any] | None = None,
        description: str | None = None,
        override: bool = False,
        **init_params: Any,
    ) -> Callable[..., Any]: ...


def parallelize_once(
    module: nn.Module, parallelize: Callable[[], PipelineRunner | None]
) -> PipelineRunner | None:
    """Make ``module`` parallel with ``parallelize`` the first time a d9d strategy sees it; the pipeline runner
    that call built, then and every later time."""
    if module not in _PARALLELIZED:
        _PARALLELIZED[module] = parallelize()
    return _PARALLELIZED[module]


def autocast_device(module: nn.Module, device_type: str) -> str | None:
    """Where ``bf16-mixed`` autocasts the forward: nowhere for a model with FSDP units (they cast through FSDP's
    ``MixedPrecisionPolicy``), on ``device_type`` for a model left without FSDP."""
    wrapped = any(isinstance(child, FSDPModule) for child in module.modules())
    return None if wrapped else device_type


class D9DStrategyBase(MeshTopology):
    """The skeleton of a d9d strategy, mixed in before Lightning's or Fabric's ``ModelParallelStrategy``."""

    strategy_name = "d9d"

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        if cls.strategy_name not in strategy_registry:  # importing twice must not fail
            strategy_registry.register(cls.strategy_name, cls, description="d9d N-D parallel training")
