"""Running a pipeline schedule inside Lightning's automatic optimization (the runner itself is in ``pipeline/``).

Two things in Lightning's loop assume that ``training_step`` only builds a graph and ``backward`` runs it:
- its closure zeroes gradients *after* ``training_step`` (on the first micro-step of an accumulation window),
  which would erase what the schedule just computed: :class:`ZeroGradFirstOptimization` zeroes first (the
  strategy uses it in every fit: the last step's gradients are then freed before the forward, not held through
  it, where a step's memory peaks);
- its ``backward`` would run ``loss.backward()`` again: the strategy skips it when pipelining.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

from lightning_d9d.compat import AutomaticOptimization


class ZeroGradFirstClosure(Closure):
    """Lightning's closure with ``zero_grad`` moved before ``training_step`` (same result without pipelining)."""

    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        if self._zero_grad_fn is not None:
            self._zero_grad_fn()
        step_output = self._step_fn()
        if self._backward_fn is not None and step_output.closure_loss is not None:
            self._backward_fn(step_output.closure_loss)
        return step_output


class ZeroGradFirstOptimization(AutomaticOptimization):
    def _make_closure(self, kwargs: Any, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
        return ZeroGradFirstClosure(
            step_fn=self._make_step_fn(kwargs),
            backward_fn=self._make_backward_fn(optimizer),
            zero_grad_fn=self._make_zero_grad_fn(batch_idx, optimizer),
        )
