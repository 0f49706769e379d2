"""Running a pipeline schedule inside Lightning's automatic optimization.

Two things in Lightning's loop assume that ``training_step`` only builds a graph and ``backward`` runs it:
- its closure zeroes gradients *after* ``training_step`` (on the first micro-step of an accumulation window),
  which would erase what the schedule just computed: :class:`ZeroGradFirstOptimization` zeroes first;
- its ``backward`` would run ``loss.backward()`` again: the strategy skips it when pipelining.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_d9d.pipeline import PipelineConfig, build_schedule, rank_of_stage
from lightning_d9d.pipeline.forward_only import pipeline_forward_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_microbatch_split(batch_size: int, microbatches: int) -> None:
    """Raised before the schedule starts any communication."""
    if batch_size % microbatches:
        raise ValueError(
            f"the per-rank batch size ({batch_size}) must be divisible by microbatches ({microbatches}); "
            "change the DataLoader's batch_size or D9DStrategy(microbatches=...)"
        )


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


class ZeroGradFirstOptimization(_AutomaticOptimization):
    def _make_closure(self, kwargs: Any, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
        return ZeroGradFirstClosure(
            step_fn=self._make_step_fn(kwargs),
            backward_fn=self._make_backward_fn(optimizer),
            zero_grad_fn=self._make_zero_grad_fn(batch_idx, optimizer),
        )


class PipelineRunner:
    """This rank's pipeline stages, the schedule over them, and the loss bookkeeping."""

    def __init__(
        self,
        config: PipelineConfig,
        stages: Mapping[int, nn.Module],
        pp_group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.config = config
        self.stages = dict(stages)
        self.group = pp_group
        self.device = device
        self.holds_first = 0 in self.stages
        self.holds_last = config.num_stages - 1 in self.stages
        self._torch_stages = [
            PipelineStage(module, index, config.num_stages, device, group=pp_group)
            for index, module in sorted(self.stages.items())
        ]
        self._schedule: Any = None
        self._user_loss: LossFn | None = None
        self._scale = 1.0

    def owner(self, stage: int) -> int:
        return rank_of_stage(stage, self.config.pp, self.config.stages_per_rank, v_shape=self.config.v_shape)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._user_loss is not None
        loss = self._user_loss(output, target)
        # The mean over microbatches and accumulation steps, as one process would compute it.
        return loss * self._scale

    def _schedule_for(self, loss_fn: LossFn) -> Any:
        if self._schedule is None or loss_fn is not self._user_loss:
            self._user_loss = loss_fn
            self._schedule = build_schedule(self.config, self._torch_stages, self._scaled_loss)
        return self._schedule

    def train_step(
        self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, loss_fn: LossFn, accumulate: int
    ) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; the mean microbatch loss on every rank."""
        check_microbatch_split(int(target.shape[0]), self.config.microbatches)
        schedule = self._schedule_for(loss_fn)
        self._scale = 1.0 / (self.config.microbatches * accumulate)
        args = inputs if self.holds_first else ()
        kwargs: dict[str, Any] = {"target": target if self.holds_last else None, "losses": []}
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            kwargs["return_outputs"] = False  # nobody reads the merged logits; don't build them
        schedule.step(*args, **kwargs)
        if self.holds_last:
            # The schedule's own list, not every loss_fn call: on its first step torch also calls the loss on
            # shape-inference outputs.
            scaled = kwargs["losses"]
            loss = torch.stack([item.detach().float() for item in scaled]).sum() / (self._scale * len(scaled))
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(
            loss,
            src=dist.get_global_rank(self.group, self.owner(self.config.num_stages - 1)),
            group=self.group,
        )
        return loss

    def eval_step(
        self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        return pipeline_forward_loss(
            self.stages, self.owner, self.config.num_stages, self.group, inputs, target, loss_fn, self.device
        )
