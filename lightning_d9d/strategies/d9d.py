"""``D9DStrategy``: Lightning's ``ModelParallelStrategy`` on a 6-D mesh with per-model parallel plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_d9d.compat import set_module_device_mesh, trainer_of, use_automatic_optimization
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
from lightning_d9d.pipeline.checks import (
    check_batches_split,
    check_pipeline_model,
    has_splittable_child,
    tied_parameters,
)
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.fp8 import Fp8Filter
from lightning_d9d.plans.lora import LoRA
from lightning_d9d.plans.memory import MemoryPlan
from lightning_d9d.strategies import cuda_graphs, prepare
from lightning_d9d.strategies.accumulation import micro_steps_per_step
from lightning_d9d.strategies.async_save import AsyncSaves
from lightning_d9d.strategies.base import D9DStrategyBase, autocast_device, parallelize_once
from lightning_d9d.strategies.checkpoint_hooks import CheckpointHooks, check_checkpoint_format
from lightning_d9d.strategies.data_ranks import reduce_over_data_ranks, sync_metrics_over_data_ranks
from lightning_d9d.strategies.gradient_sync import gradient_sync_held_back
from lightning_d9d.strategies.guards import check_collective_timeout
from lightning_d9d.strategies.launch import check_before_launch
from lightning_d9d.strategies.memory_report import PlannedRun, report_memory_plan
from lightning_d9d.strategies.pipelining import ZeroGradFirstOptimization
from lightning_d9d.strategies.precision import PrecisionSlot, as_trainer_precision
from lightning_d9d.strategies.resume import PendingRandomState

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Who cuts a model that is not PipelineSplittable itself into stages: the transformers adapter.
PIPELINE_VIEWS = (hf_pipeline_for,)


class D9DStrategy(D9DStrategyBase, CheckpointHooks):
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
            ``"max-autotune-no-cudagraphs"`` (minutes of GEMM tuning once, ``docs/benchmarks.md`` run G10) or
            ``"reduce-overhead"`` (CUDA graphs per block where they apply: ``docs/degrees.md``, "CUDA graphs").
        context_attention: attention under cp > 1: ``"auto"`` (torch's ring kernels on CUDA, the portable
            all-gather path elsewhere), ``"all_gather"``, ``"torch_ring"`` or ``"heads"`` (head-parallel: the heads
            split over cp around the model's own attention); the choice is logged once.
        reshard_after_forward: FSDP frees gathered parameters after forward (less memory, more traffic).
            ``None`` (default): where they are sharded; ``True`` also on one rank, freeing the weights' bf16 cast
            (``docs/benchmarks.md`` run U14: 3.3 GiB less at Qwen3-4B's layer x 18, 1.7 % slower).
        fsdp_on_one_rank: wrap the model in FSDP2 also in a one-process world (default: parameters are
            DTensors on every layout). ``False`` keeps plain parameters there and ``bf16-mixed`` autocasts the
            forward (``docs/benchmarks.md`` run G2: 2 % faster at Qwen3-0.6B for 2.3 GiB more).
        save_distributed_checkpoint: sharded DCP checkpoints (default) or one full file written by rank 0
            (Lightning's own format, without the guarantees of ``docs/reliability.md``: no atomic directory,
            manifest or RNG states). Refused with ``pp > 1``, where rank 0 holds only its own stages.
        timeout: how long any collective may wait (a ``timedelta``; Lightning's default is 30 minutes): a rank
            whose peer hung or died fails after it instead of waiting forever (see ``docs/reliability.md``).
        async_save: checkpoints saved during training are written in the background while training goes on
            (the state copied to CPU memory first), complete under their name once every rank's write ended
            (``strategies/async_save.py``); the next save and the end of training wait for the previous one.
        fp8: the transformer blocks' linear layers in float8 through torchao (``pip install
            'lightning-d9d[fp8]'``): ``"tensorwise"`` (fastest; float8 all-gathers where tp is 1) or ``"rowwise"``
            (a scale per row); not the embedding, head or routers (:mod:`lightning_d9d.plans.fp8`, which says
            what each does under tp). ``None`` (default): off.
        fp8_filter: ``(module, name_in_block) -> bool``, which linear layers ``fp8`` converts (default:
            :func:`~lightning_d9d.plans.fp8.fp8_linear_filter`).
        fp8_experts: with ``fp8`` on, the MoE experts' grouped GEMMs in float8 rowwise through torchao:
            ``False`` (default: 1.57x slower with experts of width 384, ``docs/benchmarks.md`` run U13) keeps
            them in bf16; ``None`` where the GPU allows it (compute capability 9.0+); ``True`` requires it
            (:func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`).
        async_tp: torch's micro-pipelined tensor parallelism (:mod:`lightning_d9d.plans.async_tp`): each
            block's tp collectives overlap its matmuls. Needs tp > 1, ``compile`` and CUDA GPUs (each refused by
            name before any process group); off by default; its speed is not measured yet.
        lora: low-rank adapters (:class:`~lightning_d9d.LoRA`) on the model's linear layers, every other
            parameter frozen; applied before every other plan, so the adapters are sharded with their layers on
            every degree. Return only the trainable parameters from ``configure_optimizers`` (``docs/finetune.md``).
        expert_tensor_parallel: under tp > 1, every MoE expert split over the tp ranks (gate and up
            column-wise, down row-wise: :mod:`lightning_d9d.plans.expert_tensor`); ``False`` (default): whole
            experts on every tp rank. Refused with ep > 1, ``LoRA(experts=True)`` and float8 experts.

    The LightningModule needs no changes. Its model is parallelized after ``configure_model``: a module (the
    LightningModule or one of its children) with a ``parallelize(dims, options)`` method applies its own
    plan; any other child gets FSDP per repeated block plus the child itself. Modules built on the meta
    device are materialized after sharding and initialised with ``init_weights(seed)`` (or
    ``reset_parameters()``).
    """

    _owner = "D9DStrategy"
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
        expert_tensor_parallel: bool = False,
    ) -> None:
        check_collective_timeout(timeout)  # before any process starts: a wrong type would fail in init
        check_checkpoint_format(save_distributed_checkpoint, pp=pp)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
        self.pipeline = check_pipeline_config(pp, pipeline_schedule, microbatches, stages_per_rank)
        self.pipeline_schedule = self.pipeline.schedule
        self._stage_layout = StageLayout(
            None if layers_per_stage is None else tuple(layers_per_stage),
            stage_embedding_weight,
            stage_head_weight,
        )
        self._runner: PipelineRunner | None = None
        self._take_degrees(
            dims,
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
            expert_tensor_parallel=expert_tensor_parallel,
        )
        self.memory_plan: MemoryPlan | None = None  # this rank's, from the first training step
        self._resumed_random_state = PendingRandomState()  # a resume's, put back at its first batch
        self._async_saves = AsyncSaves(timeout) if async_save and save_distributed_checkpoint else None

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is constructed: a mesh that does not tile the world fails here, before any
        # process is launched.
        self._check_options_on_device(self._resolve_dims())
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
        self._check_options_on_device(dims)
        self._build_mesh(dims)  # before configure_model and the blocks' compile
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self.device_mesh)

    # the Trainer(precision=...) choice as a D9DPrecision (Lightning's property, typed as any plugin)
    precision_plugin = PrecisionSlot("_precision_plugin", as_trainer_precision, Precision)  # type: ignore[assignment,override]

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
            # would otherwise stay allocated through the forward, where a step's memory peaks (a few GiB at the
            # MoE benchmark shape).
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
    def model_to_device(self) -> None:
        # Tensors on the meta device get their memory after sharding (``_materialize``).
        assert self.model is not None
        if not prepare.has_meta_tensors(self.model):
            self.model.to(self.root_device)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Parallelize the LightningModule in place, once: a later fit or validate on it reuses the result."""
        prepare.refuse_fsdp1(model)
        self._runner = parallelize_once(model, lambda: self._parallelize(model))
        self.precision_plugin.autocast_device = autocast_device(model, self.root_device.type)
        if self._runner is not None:
            self.precision_plugin.norm_reduce_groups = self._runner.grad_norm_groups
        sync_metrics_over_data_ranks(model, self._dims)
        return model

    def _parallelize(self, model: nn.Module) -> PipelineRunner | None:
        """The first time: the plans, on this rank's stages under pp; the pipeline runner, if any."""
        self._check_pipeline_model(built_only=False)  # on every rank alike, before the first collective
        prepare.adapt(model, self._options)
        prepare.broadcast_plain_tensors(model, self.root_device, self.world_size)
        dims = self.parallel_dims
        if not dims.pp_enabled:
            prepare.parallelize(model, dims, self.parallel_options())
            prepare.materialize(model, self.root_device, self.broadcast)
            return None
        pipelined, splittable = find_splittable(model, PIPELINE_VIEWS)
        tied = tied_parameters(pipelined)  # before the carving leaves each rank its own copy
        stages = carve_stages(splittable, self.pipeline, dims, self._stage_layout)
        prepare.parallelize(model, dims, self.parallel_options(), stages)
        prepare.materialize(model, self.root_device, self.broadcast)
        return PipelineRunner(self.pipeline, pipelined, stages, dims, self.root_device, tied)

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
        """All-reduce for ``self.log(..., sync_dist=True)``, by default over the ranks that hold different tokens
        (:mod:`~lightning_d9d.strategies.data_ranks`), with no barrier before it."""
        return reduce_over_data_ranks(tensor, self._dims, group, reduce_op)

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
        context = LossContext(
            self,
            self._runner,
            accumulate=micro_steps_per_step(module),
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

    # ------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if cuda_graphs.training_step_marks(self.lightning_module):
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
        """A new step begins, for cudagraph trees (:func:`~lightning_d9d.strategies.cuda_graphs.mark_step`)."""
        cuda_graphs.mark_step(self.root_device, self._options.compile)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter / all-reduce on accumulation micro-steps; the last micro-step reduces the sum
        (:mod:`~lightning_d9d.strategies.gradient_sync`)."""
        with gradient_sync_held_back(self.model, self._runner):
            yield
