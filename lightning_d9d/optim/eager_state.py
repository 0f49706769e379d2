"""Optimizers whose state exists from their construction, before any step."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EagerState(Protocol):
    """An optimizer that builds its state when it is built (``StochasticAdamW``: a checkpoint then loads into it
    before its first step, DCP mapping the checkpoint's entries onto the state keys it finds). Whoever replaces
    its parameters before the first step (``fabric.setup(model, optimizer)`` hands it the sharded ones) asks
    :meth:`has_stepped` and calls :meth:`rebuild_state`."""

    def has_stepped(self) -> bool:
        """Whether any parameter took a step: its state then holds more than construction built."""
        ...

    def rebuild_state(self) -> None:
        """The state as construction builds it, for the parameters the groups hold now (any other entry dropped)."""
        ...
