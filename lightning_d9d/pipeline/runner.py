"""This rank's pipeline stages and the schedule over them: one training or forward-only step per batch.

The loss layer (:mod:`lightning_d9d.loss.step`) hands a batch over with everything its loss needs, so that the
runner never calls back up: the inputs, the labels, the token scale of the global batch (``item_scale``), the
gradient factor of token-weighted accumulation (``grad_factor``) and whether the last stage computes the loss
fused (``fused_ignore_index``). The per-microbatch scaling lives here: torch's schedule calls the loss once per
microbatch, and each call is scaled so that the summed gradients are those of one process on the whole batch
(``scale_grads=False``; see ``build_schedule``). With a :class:`~lightning_d9d.modules.loss.CountedLoss` each
microbatch weighs by the items it counts (tokens that are not padding) times ``item_scale``, otherwise every
microbatch weighs the same; ``grad_factor`` scales the gradients and not the returned loss.

With ``fused_ignore_index`` the last stage computes the loss itself: it gets each microbatch's labels as
``labels=`` / ``ignore_index=`` keyword arguments (torch splits keyword arguments into microbatches like the
inputs) and returns the mean loss instead of logits, so the head's ``[tokens, vocab]`` logits never exist and
the head weight is used inside the stage's forward, where FSDP has gathered it. The loss function then only
weighs that loss.

``stage_kwargs`` (a packed batch's ``position_ids``) reach every stage's forward by the same mechanism, split into
microbatches with the inputs: each stage builds its own layers' document mask from its microbatch's positions.
A stage whose forward does not take them is refused before the schedule runs (:meth:`check_stage_kwargs`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from lightning_d9d.compat import gradient_sync_held_off
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.mesh.arrival import named_collective
from lightning_d9d.modules.loss import CountedLoss, scale_gradient
from lightning_d9d.modules.moe import paused_load_counting
from lightning_d9d.pipeline.forward_only import pipeline_forward_loss
from lightning_d9d.pipeline.schedules import PipelineConfig, build_schedule
from lightning_d9d.pipeline.split import rank_of_stage
from lightning_d9d.pipeline.tied import TiedAcrossStages
from lightning_d9d.plans.tensor import local_loss, maybe_loss_parallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_microbatch_split(batch_size: int, microbatches: int) -> None:
    """Raised before the schedule starts any communication."""
    if batch_size % microbatches:
        raise ValueError(
            f"the per-rank batch size ({batch_size}) must be divisible by microbatches ({microbatches}); "
            "change the DataLoader's batch_size or D9DStrategy(microbatches=...)"
        )


class AccumulatingStage(PipelineStage):
    """torch's ``PipelineStage``, except that gradient reduction can wait for the last accumulation step.

    torch reduce-scatters a stage's FSDP gradients at the end of every ``schedule.step`` (its
    ``perform_reduce_grad`` switches gradient sync on). While ``sync_gradients`` is False that switch is held
    off, so FSDP keeps accumulating unsharded gradients, as ``set_requires_gradient_sync(False)`` does without
    pipelining; the step that syncs reduces the sum once. Both ``perform_reduce_grad`` and the way it calls the
    switch are torch internals that :mod:`lightning_d9d.compat` lists (``gradient_sync_held_off``).
    """

    sync_gradients: bool = True

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        module = self.submod
        if self.sync_gradients or not isinstance(module, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)
            return
        with gradient_sync_held_off(module):
            super().perform_reduce_grad(grad_scale_factor)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # torch infers shapes on the first step with a forward over placeholder tensors: MoE routers must not
        # count that forward's expert load (the bias update would see tokens that were never trained on).
        with paused_load_counting(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)


def _unweighted(microbatch: torch.Tensor) -> float:
    return 1.0


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """Three numbers that differ, in practice, between any two different batches (and never for equal ones)."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(65521).add_(1)
    return torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(), (flat * weights).sum()])


class PipelineRunner:
    """This rank's pipeline stages, the schedule over them, and the loss bookkeeping."""

    def __init__(
        self,
        config: PipelineConfig,
        model: nn.Module,
        stages: Mapping[int, nn.Module],
        dims: ParallelDims,
        device: torch.device,
        tied: Sequence[tuple[str, str]] = (),
    ) -> None:
        """``tied``: the names under which ``model`` held one parameter before the stages were carved
        (:func:`~lightning_d9d.pipeline.checks.tied_parameters`); copies on several ranks train as one
        (:mod:`lightning_d9d.pipeline.tied`)."""
        self.config = config
        # The trimmed model the stages share their modules with, held weakly: the strategies keep the runner in a
        # weak map keyed by the user's module, which may be this model itself.
        self._model = weakref.ref(model)
        self.stages = dict(stages)
        self.pp = dims.pp
        self.num_stages = config.num_stages(dims.pp)
        self.group = dims.mesh_for("pp").get_group()
        # Under tp the last stage's logits stay sharded on the vocabulary dim: the loss and its backward run
        # under torch's loss_parallel, inside the schedule step.
        self.loss_parallel = dims.tp_enabled
        self.device = device
        self.holds_first = 0 in self.stages
        self.holds_last = self.num_stages - 1 in self.stages
        self._torch_stages = [
            AccumulatingStage(module, index, self.num_stages, device, group=self.group)
            for index, module in sorted(self.stages.items())
        ]
        self._schedule: Any = None
        self._user_loss: LossFn | None = None
        self._weight: Callable[[torch.Tensor], torch.Tensor | float] = _unweighted
        self._grad_factor: torch.Tensor | None = None  # see train_step's grad_factor
        self._stage_computes_loss = False  # the last stage was handed the labels (see the module docstring)
        self._checked: set[str] = set()  # "train" / "eval": whose first batch was compared
        self._accepted_kwargs: set[frozenset[str]] = set()  # keyword-input names every local stage takes
        self._tied = TiedAcrossStages(model, tied, self.group, device)
        self._tied.sync_values()  # the copies alike from the start; again before the first step (loads)
        self._tied_loaded = False

    @property
    def model(self) -> nn.Module | None:
        """The pipelined model (None once it is gone)."""
        return self._model()

    @property
    def grad_norm_groups(self) -> list[dist.ProcessGroup]:
        """Groups over which gradient norms add up: the other stages' parameters live on the pp peers."""
        return [self.group]

    @property
    def sync_gradients(self) -> bool:
        return all(stage.sync_gradients for stage in self._torch_stages)

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        for stage in self._torch_stages:
            stage.sync_gradients = value

    def owner(self, stage: int) -> int:
        return rank_of_stage(stage, self.pp, self.config.stages_per_rank, v_shape=self.config.v_shape)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._user_loss is not None
        loss = output if self._stage_computes_loss else local_loss(self._user_loss(output, target))
        weighted = loss * self._weight(target)
        if self._grad_factor is None:
            return weighted
        return scale_gradient(weighted, self._grad_factor)  # the same value, the gradient times the factor

    def _schedule_for(self, loss_fn: LossFn) -> Any:
        # The schedule calls _scaled_loss, which reads the step's loss_fn: one schedule serves any loss.
        self._user_loss = loss_fn
        if self._schedule is None:
            self._schedule = build_schedule(self.config, self._torch_stages, self._scaled_loss)
        return self._schedule

    def _forget_step(self) -> None:
        """Drop the step's loss function: it may be a bound method of the user's module, which the runner must
        not keep alive (see ``_model``)."""
        self._user_loss = None
        self._weight = _unweighted

    def _sync_tied_after_loads(self) -> None:
        if not self._tied_loaded:
            self._tied_loaded = True
            self._tied.sync_values()

    def check_stage_kwargs(self, stage_kwargs: Mapping[str, Any]) -> None:
        """Refuse keyword inputs a local stage's forward does not take, naming the stage and the keyword (before
        any collective: the other ranks check their own stages alike). Each set of names once: not every step."""
        names = frozenset(stage_kwargs)
        if names in self._accepted_kwargs:
            return
        for index, stage in sorted(self.stages.items()):
            parameters = inspect.signature(stage.forward).parameters
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
                continue
            missing = sorted(set(stage_kwargs) - set(parameters))
            if missing:
                raise ValueError(
                    f"pipeline stage {index} ({type(stage).__name__}) takes no {', '.join(missing)}: every stage "
                    f"gets them (a packed batch's positions build each stage's document mask). Give its forward "
                    f"a keyword argument {missing[0]}=None, or train without it (pp=1 takes any input)"
                )
        self._accepted_kwargs.add(names)

    def check_same_batch(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, mode: str) -> None:
        """Every pipeline rank must hold the same batch: stage 0 reads the inputs on one rank and the last stage
        the targets on another. Checked on the first batch of each ``mode`` (one small all-gather, one host
        read): training and validation data come from different loaders."""
        if mode in self._checked:
            return
        self._checked.add(mode)
        digest = torch.cat([_digest(tensor) for tensor in (*inputs, target)]).to(self.device)
        gathered = [torch.empty_like(digest) for _ in range(self.pp)]
        with named_collective("the pipeline's same-batch check (all_gather)", self.group):
            dist.all_gather(gathered, digest, group=self.group)
        differ = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
        if differ:
            raise ValueError(
                f"the pipeline ranks got different batches (pp rank 0 and pp rank(s) {differ}): stage 0 would "
                "read one batch's inputs and the last stage another batch's targets. Every rank of a pipeline "
                "must load the same batch: let Lightning add the sampler (Trainer(use_distributed_sampler=True), "
                "the default), or shard your data by the data-parallel rank "
                "(trainer.strategy.distributed_sampler_kwargs), not by the global RANK"
            )

    def train_step(
        self,
        inputs: tuple[torch.Tensor, ...],
        target: torch.Tensor,
        loss_fn: LossFn,
        *,
        accumulate: int,
        item_scale: torch.Tensor | None = None,
        grad_factor: torch.Tensor | None = None,
        fused_ignore_index: int | None = None,
        stage_kwargs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; returns the batch loss on every rank.

        ``item_scale``: for a :class:`CountedLoss`, ``data-parallel ranks / items in the global batch``. A
        microbatch then weighs ``count(microbatch) * item_scale``, which makes the summed gradients (and the
        loss, once averaged over the data-parallel ranks) the mean over every counted item of the global batch.
        Without it each microbatch weighs ``1 / microbatches``. Both are divided by ``accumulate``.

        ``grad_factor``: a 0-d tensor the gradients (not the returned loss) are multiplied by, for token-weighted
        accumulation (the batch's share of the optimizer step, ``N_m / R``: see
        :class:`~lightning_d9d.strategies.accumulation.StepTokens`); None: 1.

        ``fused_ignore_index``: the last stage computes ``loss_fn`` itself (see the module docstring).
        ``stage_kwargs``: keyword inputs of every stage, split into microbatches (see the module docstring).
        """
        stage_kwargs = stage_kwargs or {}
        check_microbatch_split(int(target.shape[0]), self.config.microbatches)
        self.check_stage_kwargs(stage_kwargs)
        self.check_same_batch((*inputs, *stage_kwargs.values()), target, "train")
        schedule = self._schedule_for(loss_fn)
        if item_scale is not None:
            counted: CountedLoss = loss_fn  # type: ignore[assignment]
            scale = item_scale / accumulate
            self._weight = lambda microbatch: counted.count(microbatch) * scale
        else:
            self._weight = lambda microbatch: 1.0 / (self.config.microbatches * accumulate)
        args = inputs if self.holds_first else ()
        kwargs: dict[str, Any] = {"target": target if self.holds_last else None, "losses": []}
        kwargs.update(self._last_stage_kwargs(target, fused_ignore_index))
        kwargs.update(stage_kwargs)
        self._stage_computes_loss = fused_ignore_index is not None
        self._grad_factor = grad_factor
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            kwargs["return_outputs"] = False  # nobody reads the merged logits; don't build them
        self._sync_tied_after_loads()
        try:
            with maybe_loss_parallel(self.loss_parallel):
                schedule.step(*args, **kwargs)
        finally:
            self._forget_step()
        if self.sync_gradients:  # the gradients of the optimizer step are complete: the tied copies' summed
            self._tied.sum_gradients()
        if self.holds_last:
            # The schedule's own list, not every loss_fn call: on its first step torch also calls the loss on
            # shape-inference outputs.
            loss = torch.stack([item.detach().float() for item in kwargs["losses"]]).sum() * accumulate
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(
            loss, src=dist.get_global_rank(self.group, self.owner(self.num_stages - 1)), group=self.group
        )
        return loss

    def eval_step(
        self,
        inputs: tuple[torch.Tensor, ...],
        target: torch.Tensor,
        loss_fn: LossFn,
        *,
        fused_ignore_index: int | None = None,
        stage_kwargs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The loss of the whole batch, forward only, on every pipeline rank (``fused_ignore_index``,
        ``stage_kwargs``: as in :meth:`train_step`)."""
        stage_kwargs = stage_kwargs or {}
        self.check_stage_kwargs(stage_kwargs)
        self.check_same_batch((*inputs, *stage_kwargs.values()), target, "eval")
        self._sync_tied_after_loads()

        def plain_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return output if fused_ignore_index is not None else local_loss(loss_fn(output, target))

        with maybe_loss_parallel(self.loss_parallel):
            return pipeline_forward_loss(
                self.stages,
                self.owner,
                self.num_stages,
                self.group,
                inputs,
                target,
                plain_loss,
                self.device,
                last_stage_kwargs=self._last_stage_kwargs(target, fused_ignore_index),
                stage_kwargs=stage_kwargs,
            )

    def _last_stage_kwargs(self, target: torch.Tensor, fused_ignore_index: int | None) -> dict[str, Any]:
        """The keyword arguments with which the last stage computes the loss itself; none when it returns
        logits or this rank does not hold it (a rank's keyword arguments reach all its stages; only the last
        one reads them)."""
        if fused_ignore_index is None or not self.holds_last:
            return {}
        return {"labels": target, "ignore_index": fused_ignore_index}
