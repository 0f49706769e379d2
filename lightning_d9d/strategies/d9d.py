"""``D9DStrategy``: Lightning's ``ModelParallelStrategy`` on a 6-D mesh with per-model parallel plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_d9d.callbacks.hf import LoadHFWeights
from lightning_d9d.compat import (
    FilePath,
    StrategyRegistryType,
    set_module_device_mesh,
    trainer_of,
    unwrap_optimizer,
    use_automatic_optimization,
)
from lightning_d9d.loss import LossContext, compute_loss, fuses_head, micro_step_gradient, vocab_parallel
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import hf_pipeline_for
from lightning_d9d.modules.inputs import ModelInputs
from lightning_d9d.modules.loss import CountedLoss
from lightning_d9d.optim import check_master_weight_run
from lightning_d9d.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelineRunner,
    StageLayout,
    carve_stages,
    check_pipeline_config,
    find_splittable,
)
from lightning_d9d.pipeline.checks import check_batches_split, check_pipeline_model, has_splittable_child
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.plans import (
    IMPLEMENTED,
    ParallelOptions,
    require_degrees,
)
from lightning_d9d.plans.async_tp import enable_async_tp
from lightning_d9d.plans.compile import compile_mode, uses_cudagraphs
from lightning_d9d.plans.fp8 import Fp8Filter
from lightning_d9d.plans.lora import LoRA
from lightning_d9d.plans.memory import MemoryPlan
from lightning_d9d.state import frozen as frozen_checkpoint
from lightning_d9d.state import selection as checkpoint_selection
from lightning_d9d.state import training as training_checkpoint
from lightning_d9d.strategies import prepare
from lightning_d9d.strategies.async_save import AsyncSaves
from lightning_d9d.strategies.guards import check_collective_timeout
from lightning_d9d.strategies.hf_record import with_hf_config
from lightning_d9d.strategies.launch import check_before_launch
from lightning_d9d.strategies.memory_report import PlannedRun, report_memory_plan
from lightning_d9d.strategies.options import check_options_on_device, checked_parallel_options
from lightning_d9d.strategies.pipelining import ZeroGradFirstOptimization
from lightning_d9d.strategies.precision import D9DPrecision
from lightning_d9d.strategies.process_exit import destroy_process_group_at_exit
from lightning_d9d.strategies.resume import PendingRandomState, resume_where_fit_stopped
from lightning_d9d.strategies.topology import MeshTopology

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Who cuts a model that is not PipelineSplittable itself into stages: the transformers adapter.
PIPELINE_VIEWS = (hf_pipeline_for,)


def check_checkpoint_format(save_distributed_checkpoint: bool, *, pp: int) -> None:
    """Refuse one full checkpoint file under a pipeline: Lightning's file save gathers the state of rank 0's
    module, which under ``pp > 1`` holds only its own stages (the other layers, the final norm and the head
    would be missing from the file, silently)."""
    if not save_distributed_checkpoint and pp > 1:
        raise ValueError(
            f"D9DStrategy(pp={pp}, save_distributed_checkpoint=False) would save only rank 0's pipeline stage: "
            "keep save_distributed_checkpoint=True (the default: every stage, atomic, with a manifest); for one "
            "set of weight files, export with the ExportHF callback or `python -m lightning_d9d.convert dcp-to-hf`"
        )


class D9DStrategy(MeshTopology, ModelParallelStrategy):
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
        activation_checkpointing: recompute in backward: ``True`` / ``"full"`` each transformer block whole,
            ``"selective"`` only its element-wise ops (matmul and attention outputs kept).
        compile: ``torch.compile`` each transformer block: ``True`` (torch's default mode) or a mode name, e.g.
            ``"max-autotune-no-cudagraphs"`` (Triton GEMM templates benchmarked against cuBLAS per shape at
            compile time: minutes once, measured in ``docs/benchmarks.md``), or ``"reduce-overhead"``: CUDA
            graphs per block, on one GPU with ``fsdp_on_one_rank=False`` and dense blocks; elsewhere the blocks
            compile without them and a warning says why (``docs/degrees.md``, "CUDA graphs").
        context_attention: attention under cp > 1: ``"auto"`` (torch's ring kernels on CUDA, the portable
            all-gather path elsewhere), ``"all_gather"`` or ``"torch_ring"``; the choice is logged once.
        reshard_after_forward: FSDP frees gathered parameters after forward (less memory, more traffic).
            ``None`` (default): where they are sharded; ``True`` also on one rank, where the gathered copy is
            the bf16 cast of the weights (3.3 GiB less at Qwen3-4B's layer x 18 on one H100, 1.7 % slower).
        fsdp_on_one_rank: wrap the model in FSDP2 also when the world is one process (the default: parameters
            are DTensors on every layout). ``False`` keeps plain parameters there, and ``bf16-mixed`` then
            autocasts the forward to bf16 (fp32 parameters, gradients and optimizer state, as with FSDP): no
            per-block all-gather copies, but autocast's own casts; no faster than the default in the H200
            runs so far (``docs/benchmarks.md``).
        save_distributed_checkpoint: sharded DCP checkpoints (default) or one full file written by rank 0
            (Lightning's own format, without the guarantees of ``docs/reliability.md``: no atomic directory,
            manifest or RNG states). Refused with ``pp > 1``, where rank 0 holds only its own stages.
        timeout: how long any collective may wait (a ``timedelta``; Lightning's default is 30 minutes): a rank
            whose peer hung or died fails after it instead of waiting forever (see ``docs/reliability.md``).
        async_save: checkpoints saved during training are written in the background while training goes on
            (the state copied to CPU memory first), complete under their name once every rank's write ended
            (``strategies/async_save.py``); the next save and the end of training wait for the previous one.
        fp8: train the transformer blocks' linear layers in float8 through torchao (``pip install
            'lightning-d9d[fp8]'``): ``"tensorwise"`` (fastest; FSDP2 all-gathers the weights in float8 where tp
            is 1) or ``"rowwise"`` (a scale per row: more robust to outliers). Not the embedding, the head or routers
            (:mod:`lightning_d9d.plans.fp8`). Under tp > 1 tensorwise takes torchao's float8 tp styles (one
            process's scales); rowwise torch's plain ones, its scales per tp shard where tp splits a contraction.
            ``None`` (default): off.
        fp8_filter: ``(module, name_in_block) -> bool``, which linear layers ``fp8`` converts (default:
            :func:`~lightning_d9d.plans.fp8.fp8_linear_filter`).
        fp8_experts: with ``fp8`` on, the MoE experts (ours, and a ``transformers`` MoE's stacked experts through
            the adapter's forward) run their GEMMs in float8 rowwise through torchao (under either recipe:
            torchao's grouped GEMM is rowwise): ``False`` (default: at our MoE shape, experts of width
            384, the step was 1.57x slower with them on an H100, 2026-12-05) keeps them in bf16; ``None`` where
            the GPU allows it (compute capability 9.0+), bf16 elsewhere with one log line; ``True`` requires it
            (refused elsewhere; :func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`).
        async_tp: torch's micro-pipelined tensor parallelism (:mod:`lightning_d9d.plans.async_tp`): Inductor
            overlaps each block's tp all-gather / reduce-scatter with its matmuls through CUDA symmetric memory.
            Needs tp > 1, ``compile`` on and CUDA GPUs (each refused by name before any process group); off by
            default. Not yet measured on GPUs (issue 28's two-GPU runs).
        lora: low-rank adapters (:class:`~lightning_d9d.LoRA`: rank, alpha, dropout, the layers by name pattern,
            the frozen weights' dtype) on the model's linear layers, every other parameter frozen; applied before
            every other plan, so the adapters are sharded with their layers on every degree. Return only the
            trainable parameters from ``configure_optimizers`` (``docs/finetune.md``). With ``fp8`` the adapted
            layers' base multiplies in float8 and the adapters in their own dtype; refused with ``fp8`` under tp.

    The LightningModule needs no changes. Its model is parallelized after ``configure_model``: a module (the
    LightningModule or one of its children) with a ``parallelize(dims, options)`` method applies its own
    plan; any other child gets FSDP per repeated block plus the child itself. Modules built on the meta
    device are materialized after sharding and initialised with ``init_weights(seed)`` (or
    ``reset_parameters()``).
    """

    strategy_name = "d9d"
    _mesh_ready_after = "the Trainer set up the processes"

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
        activation_checkpointing: bool | str = False,
        compile: bool | str = False,
        context_attention: str = "auto",
        reshard_after_forward: bool | None = None,
        fsdp_on_one_rank: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        async_save: bool = False,
        fp8: str | None = None,
        fp8_filter: Fp8Filter | None = None,
        fp8_experts: bool | None = False,
        async_tp: bool = False,
        lora: LoRA | None = None,
    ) -> None:
        check_collective_timeout(timeout)  # before any process starts: a wrong type would fail in init
        check_checkpoint_format(save_distributed_checkpoint, pp=pp)
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
        self._stage_layout = StageLayout(
            None if layers_per_stage is None else tuple(layers_per_stage),
            stage_embedding_weight,
            stage_head_weight,
        )
        self._runner: PipelineRunner | None = None
        # every degree has a plan today; this keeps a degree added to ParallelDims from training without one
        require_degrees(self._requested_dims, supported=IMPLEMENTED, owner="D9DStrategy")
        self._dims: ParallelDims | None = None
        # every plan option refused here if it cannot apply, before any process group
        self._options = checked_parallel_options(
            self._requested_dims,
            owner="D9DStrategy",
            lora=lora,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            context_attention=context_attention,
            reshard_after_forward=reshard_after_forward,
            fsdp_on_one_rank=fsdp_on_one_rank,
            fp8=fp8,
            fp8_filter=fp8_filter,
            fp8_experts=fp8_experts,
            async_tp=async_tp,
        )
        self.memory_plan: MemoryPlan | None = None  # this rank's, from the first training step
        self._resumed_random_state = PendingRandomState()  # a resume's, put back at its first batch
        self._async_saves = AsyncSaves(timeout) if async_save and save_distributed_checkpoint else None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        if cls.strategy_name not in strategy_registry:  # importing twice must not fail
            strategy_registry.register(cls.strategy_name, cls, description="d9d N-D parallel training")

    # ----------------------------------------------------------------------------------------- topology
    def _resolve_dims(self) -> ParallelDims:
        return self._requested_dims.resolve(self.num_nodes * self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is constructed: a mesh that does not tile the world fails here, before any
        # process is launched.
        check_options_on_device(
            self._options, self._resolve_dims(), self.root_device.type, owner="D9DStrategy"
        )
        super()._configure_launcher()
        if self._launcher is not None:  # pipeline settings vs. a model built already: before processes start
            check_before_launch(self._launcher, lambda: self._check_pipeline_model(built_only=True))
        # A launcher always (a direct one where Lightning starts no processes), whose launch first puts back the
        # checkpoints a crash left aside: Lightning resolves ckpt_path="last" inside it, before any other hook.
        from lightning_d9d.strategies.put_back import put_back_before_launch

        self._launcher = put_back_before_launch(self._launcher)

    @override
    def setup_environment(self) -> None:
        # Validate again (the cluster environment may have changed the world size), still before any collective.
        dims = self._resolve_dims()
        check_options_on_device(self._options, dims, self.root_device.type, owner="D9DStrategy")
        self._setup_distributed()
        destroy_process_group_at_exit()  # not left to the interpreter's teardown, where gloo can abort
        self._dims = dims.build_mesh(self.root_device.type, timeout=self._timeout)
        self._device_mesh = self._dims.mesh
        if self._options.async_tp:  # before configure_model and the blocks' compile
            enable_async_tp(self._dims.mesh_for("tp").get_group().group_name)
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self.device_mesh)

    # ---------------------------------------------------------------------------------------- precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> D9DPrecision:
        if not isinstance(self._precision_plugin, D9DPrecision):
            # Kept, not made anew on each access: the strategy sets state on it (the norm-reduce groups).
            self._precision_plugin = _as_d9d_precision(self._precision_plugin or Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _as_d9d_precision(plugin)

    # -------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Lightning's generic sequence (accelerator, precision conversion, device, ``_setup_model``, optimizers,
        # precision plugin), not ModelParallelStrategy's: that one insists on ``configure_model`` and
        # materializes meta modules before sharding, while this strategy parallelizes any module itself.
        Strategy.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # Zero (free) gradients before the step's first forward, not after its training_step as Lightning
            # does (a private Lightning class: see compat). Under pp the schedule computes gradients inside
            # training_step, which a later zero_grad would erase; with CUDA graphs the forward may reuse the memory
            # of the last step's gradients (see _mark_cudagraph_step); and in every run the last step's gradients
            # would otherwise stay allocated through the forward, where a step's memory peaks (3.0 GiB of the
            # MoE benchmark shape's 40.6, docs/benchmarks.md, session 27).
            use_automatic_optimization(trainer, ZeroGradFirstOptimization)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        check_master_weight_run(
            self.optimizers,
            precision=self.precision_plugin.precision,
            autocast=self.precision_plugin.autocast_device is not None,
            accumulate=trainer.accumulate_grad_batches,
            pipeline_degree=self.parallel_dims.pp,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The checkpoint's random states, if no ResumableDataLoader put them back at its first batch already (a
        # loader of the user's with its own state_dict): here, once, where the resume is mid-epoch. At an epoch
        # boundary the load's restore stands (the new iterator draws its seed from it, as uninterrupted).
        if self._async_saves is not None:  # a background save whose writes all ended becomes complete here
            self._async_saves.poll()
        if batch_idx > 0:
            self._resumed_random_state.restore()
        self._resumed_random_state.discard()

    @override
    def model_to_device(self) -> None:
        # Tensors on the meta device get their memory after sharding (``_materialize``).
        assert self.model is not None
        if not prepare.has_meta_tensors(self.model):
            self.model.to(self.root_device)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Parallelize the LightningModule in place, once: a later fit or validate on it reuses the result."""
        prepare.refuse_fsdp1(model)
        if not getattr(model, "_d9d_parallelized", False):
            self._check_pipeline_model(built_only=False)  # on every rank alike, before the first collective
            prepare.adapt(model, self._options)
            prepare.broadcast_plain_tensors(model, self.root_device, self.world_size)
            runner = None
            if self.parallel_dims.pp_enabled:
                pipelined, splittable = find_splittable(model, PIPELINE_VIEWS)
                stages = carve_stages(splittable, self.pipeline, self.parallel_dims, self._stage_layout)
                prepare.parallelize(model, self.parallel_dims, self.parallel_options(), stages)
            else:
                prepare.parallelize(model, self.parallel_dims, self.parallel_options())
            prepare.materialize(model, self.root_device, self.broadcast)
            if self.parallel_dims.pp_enabled:
                runner = PipelineRunner(
                    self.pipeline, pipelined, stages, self.parallel_dims, self.root_device
                )
            model._d9d_parallelized = True  # type: ignore[assignment]
            model._d9d_runner = runner  # type: ignore[assignment]
        self._runner = getattr(model, "_d9d_runner", None)
        # bf16-mixed casts through FSDP's MixedPrecisionPolicy; a model left without FSDP autocasts instead.
        wrapped = any(isinstance(module, FSDPModule) for module in model.modules())
        self.precision_plugin.autocast_device = None if wrapped else self.root_device.type
        if self._runner is not None:
            self.precision_plugin.norm_reduce_groups = self._runner.grad_norm_groups
        self._sync_metrics_over_data_ranks(model)
        return model

    def _check_pipeline_model(self, *, built_only: bool) -> None:
        """Pipeline settings against the model (stages vs. layers, tied weights); ``built_only``: skip if the
        pipelined model does not exist yet (``configure_model`` builds it after the processes start)."""
        module, pp = self.lightning_module, self._requested_dims.pp
        if module is None or pp <= 1 or (built_only and not has_splittable_child(module, PIPELINE_VIEWS)):
            return
        check_pipeline_model(module, self.pipeline, pp, self._stage_layout, PIPELINE_VIEWS)

    def parallel_options(self) -> ParallelOptions:
        return dataclasses.replace(
            self._options,
            mp_policy=self.precision_plugin.mixed_precision_policy(),
            # Split-backward schedules compute weight gradients after FSDP would have freed the parameters.
            reshard_after_forward=False
            if self._requested_dims.pp > 1 and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES
            else self._options.reshard_after_forward,
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader gets a resumable position: a checkpoint saved mid-epoch resumes at the next
        batch instead of replaying the epoch from batch 0 (see :mod:`lightning_d9d.strategies.data`)."""
        from lightning_d9d.strategies.data import ResumableDataLoader, resumable

        module = self.lightning_module
        if module is None or trainer_of(module) is None or not module.trainer.training:
            return dataloader  # validation, test and predict loaders are never resumed
        if self._runner is not None:  # a batch the schedule cannot split fails now, not at the epoch's end
            check_batches_split(dataloader, self.pipeline.microbatches, module.trainer.limit_train_batches)
        loader = resumable(dataloader)
        if isinstance(loader, ResumableDataLoader):
            loader.random_state = self._resumed_random_state  # restored where the uninterrupted run drew
        return loader

    # ------------------------------------------------------------------------------------- collectives
    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> torch.Tensor | Any:
        """All-reduce for ``self.log(..., sync_dist=True)`` over the ranks that hold different tokens (by
        default, the ``loss`` view): pipeline and tp peers hold the same batch, so a sum over the world would
        count it ``pp * tp`` times. No barrier before it
        (Lightning puts one there; on NCCL it blocks the host every step, and an all-reduce needs none)."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        if group is None:
            group = self._data_parallel_group()
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else (getattr(dist.ReduceOp, name.upper()) if name else reduce_op)
        dist.all_reduce(tensor, op=op, group=group)
        if mean:
            size = dist.get_world_size(group)
            return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
        return tensor

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold different tokens (the ``loss`` view: data replicas times the cp ranks that each
        hold part of every sequence); the world before the mesh exists."""
        if self._dims is None or self._dims.mesh is None:
            return None
        return self._dims.mesh_for("loss").get_group()

    def _sync_metrics_over_data_ranks(self, module: nn.Module) -> None:
        """torchmetrics syncs over the world unless told otherwise; point metrics without a group of their own
        at the ranks that hold different tokens, for the same reason as :meth:`reduce`."""
        from torchmetrics import Metric

        group = self._data_parallel_group()
        if group is None or dist.get_world_size(group) == self.parallel_dims.world_size:
            return  # those ranks are the world: nothing to change
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = group

    # --------------------------------------------------------------------------------------- the loss
    def model_loss(
        self, model: nn.Module, inputs: ModelInputs, target: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        """``loss_fn(model(*inputs), target)`` (``model(**inputs)`` for a dict); with pp > 1, run through the
        pipeline schedule instead.

        In training (gradients enabled) the pipelined loss comes back detached, with the gradients already
        computed; the strategy's ``backward`` then does nothing. Every pipeline rank gets the same value.

        For a :class:`~lightning_d9d.modules.loss.CountedLoss` (``causal_lm_loss`` is one) each rank's loss
        weighs by its share of the items (tokens) of the global batch, so that averaging over the data-parallel
        ranks (FSDP's gradient reduction, ``sync_dist``) gives the mean over all items, as one process would.
        Under ``accumulate_grad_batches > 1`` (automatic optimization) the micro-steps weigh by their items
        too: the optimizer step's gradient is the mean over every counted item of all its micro-steps (see
        :class:`~lightning_d9d.strategies.accumulation.StepTokens`); the value returned, and logged, is still
        the micro-step's own token mean.

        With cp > 1 each cp rank keeps its load-balanced part of the sequence of ``target`` and of the inputs
        shaped like it (see :func:`~lightning_d9d.plans.split_batch`) before the model runs; its loss is the
        mean over its own tokens, weighed like a data-parallel rank's.
        """
        if self.memory_plan is None and torch.is_grad_enabled() and self._training():
            # the first training step's: the inputs' shape as the user gave them (before the cp and microbatch
            # splits, which the plan applies itself), and the head as this call will run it
            head_fused = fuses_head(
                model,
                inputs,
                loss_fn,
                tensor_parallel=self._tensor_parallel(),
                pipelined=self._runner is not None,
            )
            self.memory_plan = self._report_memory_plan(inputs, head_fused=head_fused)
        # whether this micro-step weighs by its tokens: the Trainer's accumulation window (Lightning-facing)
        step_tokens = self.precision_plugin.step_tokens
        accumulating = step_tokens.enter(self.lightning_module, counted=isinstance(loss_fn, CountedLoss))
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        context = LossContext(
            self,
            self._runner,
            accumulate=trainer.accumulate_grad_batches if trainer is not None else 1,
            tokens=step_tokens if accumulating else None,
            internal_losses=module is not None,
        )
        return compute_loss(model, inputs, target, loss_fn, context)

    def _tensor_parallel(self) -> bool:
        return self._dims is not None and self._dims.tp_enabled

    def _training(self) -> bool:
        module = self.lightning_module
        return module is not None and trainer_of(module) is not None and module.trainer.training

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._runner is None:
            # token-weighted accumulation: this micro-step's gradient weighs N_m / R, its value stays (see
            # StepTokens)
            closure_loss = micro_step_gradient(closure_loss, self.precision_plugin.step_tokens)
            with vocab_parallel(self._dims):  # the vocabulary-sharded cross-entropy's backward needs it too
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward; only the hooks are left (on_before/after_backward).
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------------------------ CUDA graphs
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        opens_window = True  # of gradient accumulation: every step without it, and under manual optimization
        if module is not None and trainer is not None and module.automatic_optimization:
            opens_window = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        if opens_window:
            self._mark_cudagraph_step()
        output = super().training_step(*args, **kwargs)
        if self.memory_plan is None:
            # The step ran its forward without ``model_loss`` (which reports before its forward, knowing the
            # loss): the plan from the batch, with the logits head a plain forward and loss keep. Still before
            # the backward under automatic optimization, where a step's memory peaks.
            self.memory_plan = self._report_memory_plan(args[0] if args else kwargs.get("batch"))
        return output

    def _report_memory_plan(self, batch: Any, *, head_fused: bool = False) -> MemoryPlan | None:
        """This rank's memory plan for ``batch``, printed on rank 0 (:mod:`~lightning_d9d.strategies.memory_report`)."""
        module = self.lightning_module
        if module is None:
            return None
        optimizer = self.optimizers[0] if self.optimizers else None
        dims, pipeline, precision = self.parallel_dims, self.pipeline, str(self.precision_plugin.precision)
        run = PlannedRun(
            module, optimizer, self.root_device, dims, pipeline, precision, self.parallel_options()
        )
        return report_memory_plan(run, batch, head_fused=head_fused)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark_cudagraph_step()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark_cudagraph_step()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark_cudagraph_step()
        return super().predict_step(*args, **kwargs)

    def _mark_cudagraph_step(self) -> None:
        """Tell cudagraph trees that a new step begins, where the blocks may run as CUDA graphs.

        cudagraph trees reuse a step's graph memory only once they know the step is over: at a new "generation"
        (``CUDAGraphTreeManager.can_start_new_generation``), which without this call comes only when no forward
        waits for its backward; otherwise the next forward records behind the previous step's still-live
        outputs, or reading one of them fails ("accessing tensor output of CUDAGraphs that has been overwritten").
        A training step marks only where it opens a window of gradient accumulation: the gradients of the
        window's earlier micro-steps may live in the graphs' memory (the backward's outputs that autograd keeps
        as ``.grad``), which a new generation would hand out again; the window's opening comes after the
        zero-grad-first closure (used in every fit: see :meth:`setup`) set them to ``None``.
        Marking where no block records graphs (the plan fell back, or the device is not CUDA) changes nothing."""
        if self._may_record_cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def _may_record_cuda_graphs(self) -> bool:
        """A CUDA-graph compile mode on CUDA (the plan may still fall back: marking a step then changes nothing)."""
        return self.root_device.type == "cuda" and uses_cudagraphs(compile_mode(self._options.compile))

    # ----------------------------------------------------------------------------------- gradient sync
    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter / all-reduce on accumulation micro-steps; the last micro-step reduces the sum
        (under pp the runner's stages hold back the reduction torch's schedule would make every step)."""
        if self._runner is not None:
            self._runner.sync_gradients = False
            try:
                yield None
            finally:
                self._runner.sync_gradients = True
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
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not (self._async_saves is not None and self._in_training_loop()):
            state = super().lightning_module_state_dict()
        else:  # a background save stages the tensors into its pinned buffers: no synchronous copy to CPU here
            assert self.model is not None
            state = get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))
        if self._options.lora is not None and self._save_distributed_checkpoint:
            # LoRA: the frozen base is left out, its fingerprint recorded instead (save_checkpoint, state/frozen.py)
            assert self.model is not None
            frozen = frozen_checkpoint.frozen_names(self.model)
            state = {key: value for key, value in state.items() if key not in frozen}
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        assert self.model is not None
        # a background save stages the state into its pinned buffers: no synchronous copy to CPU here first
        on_device = self._async_saves is not None and self._in_training_loop()
        return training_checkpoint.optimizer_state(self.model, optimizer, cpu_offload=not on_device)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: FilePath, storage_options: Any | None = None
    ) -> None:
        resume_where_fit_stopped(checkpoint)  # saved after fit returned: resume at the next batch, not epoch
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("D9DStrategy.save_checkpoint(..., storage_options=...) is not supported")
        # Collective: every rank returns once the directory is in place, or raises (all, with the reason).
        # with the model's HF config when it has one: `convert dcp-to-hf` then needs no --config
        path, content = self.broadcast(Path(filepath)), with_hf_config(checkpoint, self.lightning_module)
        if self._options.lora is not None and self.model is not None:
            content[frozen_checkpoint.FINGERPRINT_KEY] = frozen_checkpoint.fingerprint(self.model)
        if self._async_saves is not None and self._in_training_loop():
            self._async_saves.save(path, content)
            return
        # the save in flight first: it is the older checkpoint, and a save of the same name (last.ckpt at the end
        # of the last epoch) would remove its temporary directory
        self.finish_pending_saves()
        training_checkpoint.save(path, content)

    def finish_pending_saves(self) -> None:
        """Complete the checkpoint being written in the background (``async_save=True``), if any: every rank calls
        it (a collective). ``Preemption`` does before the requeue that ends the job."""
        if self._async_saves is not None:
            self._async_saves.finish()

    def _in_training_loop(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.training and not trainer.fit_loop.done

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._async_saves is not None:
            self._async_saves.setup()
            assert self.lightning_module is not None
            # ModelCheckpoint(save_last="link") links last.ckpt as soon as save_checkpoint returns
            self._async_saves.link_when_complete(self.lightning_module.trainer.checkpoint_callbacks)

    @override
    def on_train_end(self) -> None:
        if self._async_saves is not None:  # the last save in flight completes before fit returns
            self._async_saves.close()
            self._async_saves.restore_links()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._async_saves is not None:
            self._async_saves.abandon()
            self._async_saves.restore_links()
        super().on_exception(exception)

    @override
    def load_checkpoint(self, checkpoint_path: FilePath, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_file():  # a checkpoint saved without a distributed checkpoint (Lightning's own format)
            refusal = checkpoint_selection.hf_model_error(path)  # a model's safetensors: LoadHFWeights' input
            if refusal is not None:
                raise refusal
            # weights_only unless the caller asked otherwise, as for meta.pt: a checkpoint is untrusted input
            checkpoint = super().load_checkpoint(path, weights_only is not False)
            resume_where_fit_stopped(checkpoint)  # written by another strategy, or by Lightning itself
            return checkpoint
        assert self.model is not None and self.lightning_module is not None
        optimizers = {i: opt for i, opt in enumerate(self.optimizers)}
        meta = training_checkpoint.load(
            path,
            self.model,
            optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            frozen=self._frozen_base() if self._options.lora is not None else None,
        )
        self._resumed_random_state.capture()  # the states the load put back
        resume_where_fit_stopped(meta)
        return meta

    def _frozen_base(self) -> dict[str, tuple[float, float, int]]:
        """LoRA: the frozen base's fingerprint, once ``LoadHFWeights`` loaded it (a LoRA checkpoint holds none)."""
        assert self.model is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, LoadHFWeights):
                callback.load_frozen_base(trainer, self.lightning_module)
        return frozen_checkpoint.fingerprint(self.model)

    @override
    def remove_checkpoint(self, filepath: FilePath) -> None:
        # ModelCheckpoint deletes the checkpoint a new one replaces as soon as save_checkpoint returns: while that
        # one is written in the background the deletion waits for it to be complete
        path = Path(filepath)
        if self._async_saves is None or not self._async_saves.remove_when_complete(path, self._remove_now):
            self._remove_now(path)

    def _remove_now(self, path: Path) -> None:
        # save_top_k / keep-last-N never deletes the only complete checkpoint of its folder (it logs why)
        if self.is_global_zero and checkpoint_selection.keep(path):
            return
        super().remove_checkpoint(path)


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
