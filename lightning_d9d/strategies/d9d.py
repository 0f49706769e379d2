"""``D9DStrategy``: Lightning's ``ModelParallelStrategy`` on a 6-D mesh with per-model parallel plans."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelineSplittable,
    balanced_stage_layers,
    check_pipeline_config,
    stages_of_rank,
)
from lightning_d9d.plans import Parallelizable, ParallelOptions, SeededInit, parallelize_default
from lightning_d9d.strategies import checkpoint as ckpt
from lightning_d9d.strategies.pipelining import LossFn, PipelineRunner, ZeroGradFirstOptimization
from lightning_d9d.strategies.precision import D9DPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Degrees whose plans have not landed yet, and what to do instead.
_NOT_YET = {
    "cp": "context parallelism",
    "tp": "tensor parallelism",
    "ep": "expert parallelism",
}


class D9DStrategy(ModelParallelStrategy):
    """Composable N-D parallel training: ``Trainer(strategy="d9d")`` or ``Trainer(strategy=D9DStrategy(...))``.

    Args:
        pp, dp_replicate, dp_shard, cp, tp, ep: parallel degrees (see :class:`~lightning_d9d.mesh.ParallelDims`);
            ``dp_shard=-1`` takes whatever the world size leaves. The default is FSDP over all ranks.
        pipeline_schedule: a ``torch.distributed.pipelining`` schedule name (used when ``pp > 1``): GPipe, 1F1B,
            Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV.
        microbatches: microbatches per batch (default: the number of stages); must divide the per-rank batch.
        stages_per_rank: pipeline stages per rank (default: 1, or 2 for the interleaved and V schedules).
        layers_per_stage: explicit layer counts per stage; default: balanced, counting the embedding and the
            head as ``stage_embedding_weight`` / ``stage_head_weight`` layers.
        activation_checkpointing: recompute each transformer block in backward.
        compile: ``torch.compile`` each transformer block.
        reshard_after_forward: FSDP frees gathered parameters after forward (less memory, more traffic).
        save_distributed_checkpoint: sharded DCP checkpoints (default) or one full file written by rank 0.

    The LightningModule needs no changes. Its model is parallelized after ``configure_model``: a module (the
    LightningModule or one of its children) with a ``parallelize(dims, options)`` method applies its own
    plan; any other child gets FSDP per repeated block plus the child itself. Modules built on the meta
    device are materialized after sharding and initialised with ``init_weights(seed)`` (or
    ``reset_parameters()``).
    """

    strategy_name = "d9d"

    def __init__(
        self,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        *,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
        stage_embedding_weight: float = 1.0,
        stage_head_weight: float = 1.0,
        activation_checkpointing: bool = False,
        compile: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._requested_dims = ParallelDims(
            pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep
        )
        self.pipeline = check_pipeline_config(pp, pipeline_schedule, microbatches, stages_per_rank)
        self.pipeline_schedule = self.pipeline.schedule
        self._layers_per_stage = None if layers_per_stage is None else list(layers_per_stage)
        self._stage_weights = (stage_embedding_weight, stage_head_weight)
        self._runner: PipelineRunner | None = None
        self._pipelined_model: nn.Module | None = None
        for degree, feature in _NOT_YET.items():
            value = getattr(self._requested_dims, degree)
            if value > 1:
                raise NotImplementedError(
                    f"{degree}={value}: {feature} is not implemented yet in lightning_d9d; use {degree}=1"
                )
        self._dims: ParallelDims | None = None
        self._activation_checkpointing = activation_checkpointing
        self._compile = compile
        self._reshard_after_forward = reshard_after_forward

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:  # importing twice must not fail
            strategy_registry.register(cls.strategy_name, cls, description="d9d N-D parallel training")

    # ----------------------------------------------------------------------------------------- topology
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees and the mesh (available once the processes are set up)."""
        if self._dims is None or self._dims.mesh is None:
            raise RuntimeError(
                "D9DStrategy.parallel_dims is available after the Trainer set up the processes"
            )
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        mesh = self.parallel_dims.mesh
        assert mesh is not None
        return mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.parallel_dims.mesh_for("dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def _resolve_dims(self) -> ParallelDims:
        return self._requested_dims.resolve(self.num_nodes * self.num_processes)

    def _configure_launcher(self) -> None:
        # Called while the Trainer is constructed: a mesh that does not tile the world fails here, before any
        # process is launched.
        self._resolve_dims()
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # Validate again (the cluster environment may have changed the world size), still before any collective.
        dims = self._resolve_dims()
        self._setup_distributed()
        self._dims = dims.build_mesh(self.root_device.type)
        self._device_mesh = self._dims.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ---------------------------------------------------------------------------------------- precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> D9DPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, D9DPrecision) else D9DPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _as_d9d_precision(plugin)

    # -------------------------------------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(module, FullyShardedDataParallel) for module in self.model.modules()):
            raise TypeError(
                "found modules wrapped in FSDP1 (FullyShardedDataParallel); the d9d strategy applies FSDP2 "
                "itself: remove the wrapper"
            )
        if not getattr(self.model, "_d9d_parallelized", False):
            self.model = self.precision_plugin.convert_module(self.model)
            self._broadcast_plain_tensors(self.model)
            stages = self._split_pipeline(self.model) if self.parallel_dims.pp_enabled else None
            self._parallelize(self.model, stages)
            self._materialize(self.model)
            if stages is not None:
                self._runner = PipelineRunner(
                    self.pipeline, stages, self.parallel_dims.mesh_for("pp").get_group(), self.root_device
                )
                self.precision_plugin.norm_reduce_groups = [self.parallel_dims.mesh_for("pp").get_group()]
            self.model._d9d_parallelized = True  # type: ignore[assignment]
        if self._runner is not None and trainer.state.fn == TrainerFn.FITTING:
            # Private Lightning API (pinned by tests): zero gradients before the schedule computes them.
            trainer.fit_loop.epoch_loop.automatic_optimization.__class__ = ZeroGradFirstOptimization
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallel_options(self) -> ParallelOptions:
        return ParallelOptions(
            mp_policy=self.precision_plugin.mixed_precision_policy(),
            # Split-backward schedules compute weight gradients after FSDP would have freed the parameters.
            reshard_after_forward=self._reshard_after_forward
            and not (self._requested_dims.pp > 1 and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES),
            activation_checkpointing=self._activation_checkpointing,
            compile=self._compile,
        )

    def _split_pipeline(self, module: nn.Module) -> dict[int, nn.Module]:
        """Trim the pipelined model to this rank's layers and build one stage module per local stage."""
        candidates = [child for child in module.children() if isinstance(child, PipelineSplittable)]
        if len(candidates) != 1:
            raise ValueError(
                f"pp={self.parallel_dims.pp} needs exactly one child module of {type(module).__name__} that "
                f"implements lightning_d9d.pipeline.PipelineSplittable (found {len(candidates)}); our models do"
            )
        model = candidates[0]
        config = self.pipeline
        layers = balanced_stage_layers(
            model.num_pipeline_layers,
            config.num_stages,
            embedding_weight=self._stage_weights[0],
            head_weight=self._stage_weights[1],
            layers_per_stage=self._layers_per_stage,
        )
        pp_rank = self.parallel_dims.mesh_for("pp").get_local_rank()
        local = stages_of_rank(pp_rank, config.pp, config.stages_per_rank, v_shape=config.v_shape)
        last = config.num_stages - 1
        model.pipeline_keep(
            sorted(i for stage in local for i in layers[stage]), first=0 in local, last=last in local
        )
        self._pipelined_model = model  # type: ignore[assignment]
        return {
            stage: model.pipeline_stage(layers[stage], first=stage == 0, last=stage == last)
            for stage in local
        }

    def _parallelize(self, module: nn.Module, stages: dict[int, nn.Module] | None = None) -> None:
        dims, options = self.parallel_dims, self.parallel_options()
        if stages is not None:
            # Each stage is its own FSDP root: the schedule calls the stages, never the model.
            for stage in stages.values():
                if isinstance(stage, Parallelizable):
                    stage.parallelize(dims, options)
                else:
                    parallelize_default(stage, dims, options)
            # the pipelined model is sharded now; other children (say, a loss head) go on below
        elif isinstance(module, Parallelizable):
            module.parallelize(dims, options)
            return
        own = [name for name, _ in itertools.chain(module.named_parameters(recurse=False))]
        if own:
            raise ValueError(
                f"{type(module).__name__} holds parameters directly ({', '.join(own[:5])}); the d9d strategy "
                "shards submodules, so put them into a submodule (for example an nn.Module attribute)"
            )
        for child in module.children():
            if not any(True for _ in child.parameters()) or _already_parallel(child):
                continue
            if isinstance(child, Parallelizable):
                child.parallelize(dims, options)
            else:
                parallelize_default(child, dims, options)

    def _broadcast_plain_tensors(self, module: nn.Module) -> None:
        """Give every rank rank 0's values for modules initialised eagerly (as DDP does), so that replicas
        and shards come from one initialisation even when ranks were seeded differently."""
        if self.world_size == 1:
            return
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_meta or isinstance(tensor, DTensor):
                continue
            moved = tensor.detach().to(self.root_device)
            dist.broadcast(moved, src=0)
            tensor.data = moved

    def _materialize(self, module: nn.Module) -> None:
        """Allocate meta tensors on the device and initialise them, one seed for all ranks."""
        if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            return
        module.to_empty(device=self.root_device)
        seed = self.broadcast(torch.initial_seed())
        uninitialised: set[str] = set()

        def initialise(current: nn.Module) -> None:
            if isinstance(current, SeededInit):
                current.init_weights(seed)
                return
            owns = any(True for _ in itertools.chain(current.parameters(False), current.buffers(False)))
            if owns:
                reset = getattr(current, "reset_parameters", None)
                if callable(reset):
                    reset()
                else:
                    uninitialised.add(type(current).__name__)
            for child in current.children():
                initialise(child)

        initialise(module)
        if uninitialised:
            rank_zero_warn(
                f"meta-device modules without init_weights() or reset_parameters() are left uninitialised: "
                f"{', '.join(sorted(uninitialised))}"
            )

    # ------------------------------------------------------------------------------------- collectives
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> torch.Tensor | Any:
        """All-reduce for ``self.log(..., sync_dist=True)``: without the barrier Lightning puts before it
        (on NCCL that barrier blocks the host every step, and an all-reduce needs none)."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else (getattr(dist.ReduceOp, name.upper()) if name else reduce_op)
        dist.all_reduce(tensor, op=op, group=group)
        if mean:
            size = dist.get_world_size(group)
            return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
        return tensor

    # --------------------------------------------------------------------------------------- the loss
    def model_loss(
        self, model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        """``loss_fn(model(*inputs), target)``; with pp > 1, run through the pipeline schedule instead.

        In training (gradients enabled) the pipelined loss comes back detached, with the gradients already
        computed; the strategy's ``backward`` then does nothing. Every pipeline rank gets the same value.
        """
        if self._runner is None:
            return loss_fn(model(*inputs), target)
        if model is not self._pipelined_model:
            raise ValueError("model_loss(model, ...) under pp > 1 must be given the pipelined model")
        if torch.is_grad_enabled():
            assert self.lightning_module is not None
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            return self._runner.train_step(inputs, target, loss_fn, accumulate)
        return self._runner.eval_step(inputs, target, loss_fn)

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward; only the hooks are left (on_before/after_backward).
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ----------------------------------------------------------------------------------- gradient sync
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter / all-reduce on accumulation micro-steps; the last micro-step reduces the sum.

        Under pp the pipeline stages manage FSDP's sync within each schedule step themselves."""
        if self._runner is not None:
            yield None
            return
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model else []
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------------------------- checkpoints
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return ckpt.optimizer_state(self.model, optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("D9DStrategy.save_checkpoint(..., storage_options=...) is not supported")
        path, token = self.broadcast((Path(filepath), uuid.uuid4().hex[:12]))
        ckpt.save_sharded(path, checkpoint, rank=self.global_rank, token=token, barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_dir():
            if not path.exists():
                raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; check ckpt_path")
            return super().load_checkpoint(path, weights_only)
        assert self.model is not None and self.lightning_module is not None
        optimizers = {i: opt for i, opt in enumerate(self.optimizers)}
        return ckpt.load_sharded(
            path,
            self.model,
            optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )


def _already_parallel(module: nn.Module) -> bool:
    """The user parallelized it in ``configure_model`` (Lightning's documented ModelParallelStrategy way)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def _as_d9d_precision(plugin: Precision) -> D9DPrecision:
    if isinstance(plugin, D9DPrecision):
        return plugin
    # Lightning's own plugins, chosen from Trainer(precision=...): keep the choice, replace the mechanism.
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        return D9DPrecision(str(getattr(plugin, "precision", "32-true")))
    raise TypeError(
        f"the d9d strategy brings its own precision plugin and cannot use {type(plugin).__name__}; pass "
        "Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true') instead of a plugin"
    )
