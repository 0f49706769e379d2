"""Traits (protocols) a module can implement so the strategy treats it specially."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans.options import ParallelOptions


@runtime_checkable
class Parallelizable(Protocol):
    """A module that knows its own parallel plan (TP/CP/EP first, then checkpointing, compile, FSDP)."""

    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None: ...


@runtime_checkable
class SeededInit(Protocol):
    """A module that initialises all its parameters and buffers from a seed, identically on any sharding.

    A transformers ``PreTrainedModel`` has an ``init_weights()`` too, without a seed: the strategy takes it for
    what it is and runs its own rules instead (:mod:`lightning_d9d.modules.hf_init`).
    """

    def init_weights(self, seed: int | None = None) -> None: ...
