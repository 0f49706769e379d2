"""``Fabric(strategy="d9d")``: the degrees and plans of ``Trainer(strategy="d9d")`` for a loop of one's own.

The model is made parallel in ``fabric.setup`` exactly as the Trainer's strategy does it (``strategies/prepare``);
``model_loss(fabric, model, inputs, target, loss_fn)`` computes a forward's loss as the Trainer's ``model_loss``
does (cp split, token-weighted ranks, vocabulary-parallel or fused cross-entropy); ``fabric.backward``,
``fabric.clip_gradients`` (mesh-aware), ``fabric.save`` / ``fabric.load`` (the Trainer's atomic checkpoint
format, resumable on another layout) work on every mesh.

Pipelines are refused: a schedule owns forward and backward of every microbatch, which a Fabric loop writes
itself (``loss = ...; fabric.backward(loss)``); ``Trainer(strategy=D9DStrategy(pp=...))`` runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import Strategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_d9d.fabric import checkpoint as fabric_checkpoint
from lightning_d9d.loss import LossContext, compute_loss, vocab_parallel
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.inputs import ModelInputs
from lightning_d9d.optim import MasterWeightAdamW, check_master_weight_run
from lightning_d9d.optim.eager_state import EagerState
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.fp8 import Fp8Filter
from lightning_d9d.plans.lora import LoRA
from lightning_d9d.state import frozen as frozen_checkpoint
from lightning_d9d.state import training as training_checkpoint
from lightning_d9d.strategies import prepare
from lightning_d9d.strategies.base import D9DStrategyBase, autocast_device, parallelize_once
from lightning_d9d.strategies.grad_norm import clip_grad_norm_, clip_grad_value_
from lightning_d9d.strategies.guards import check_collective_timeout
from lightning_d9d.strategies.precision import PrecisionSlot, as_fabric_precision, master_weight_scale


def refuse_pipeline(pp: int) -> None:
    if pp > 1:
        raise ValueError(
            f"D9DFabricStrategy(pp={pp}): a pipeline schedule runs forward and backward of every microbatch "
            "itself, which a Fabric loop writes on its own (fabric.backward); train pipelines with "
            f"Trainer(strategy=D9DStrategy(pp={pp}, ...)), or use the other degrees (dp_shard, tp, cp, ep) here"
        )


class D9DFabricStrategy(D9DStrategyBase, ModelParallelStrategy):
    """``Fabric(strategy="d9d")`` or ``Fabric(strategy=D9DFabricStrategy(...))``.

    Args: the degrees and plan options of :class:`~lightning_d9d.strategies.D9DStrategy` that apply to a
    loop of one's own: ``dp_replicate``, ``dp_shard`` (``-1``: whatever the world leaves), ``cp``, ``tp``,
    ``ep``, ``activation_checkpointing``, ``compile``, ``context_attention``, ``reshard_after_forward``,
    ``fsdp_on_one_rank``, ``fp8``, ``fp8_filter``, ``fp8_experts``, ``async_tp``, ``lora``,
    ``expert_tensor_parallel``, ``process_group_backend``, ``timeout``. ``pp > 1`` is refused (module docstring).

    Set up the model and its optimizer together (``fabric.setup(model, optimizer)``: the optimizer is given the
    parallel parameters, which replace the model's) or the model first (``fabric.setup_module``). A model built
    on the meta device (``fabric.init_module(empty_init=True)``) is given memory after sharding and initialised
    from one seed on every rank.
    """

    _owner = "D9DFabricStrategy"
    _mesh_ready_after = "fabric.launch()"

    def __init__(
        self,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        *,
        activation_checkpointing: bool | str = False,
        compile: bool | str = False,
        context_attention: str = "auto",
        reshard_after_forward: bool | None = None,
        fsdp_on_one_rank: bool = True,
        fp8: str | None = None,
        fp8_filter: Fp8Filter | None = None,
        fp8_experts: bool | None = False,
        async_tp: bool = False,
        lora: LoRA | None = None,
        expert_tensor_parallel: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # every check before any process starts
        check_collective_timeout(timeout)
        refuse_pipeline(pp)
        # the precision's part of the options (mp_policy) is known once Fabric handed the strategy its plugin
        self._take_degrees(
            ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep),
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
        super().__init__(
            parallelize_fn=self._parallelize,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    # ----------------------------------------------------------------------------------------- topology
    @override
    def _configure_launcher(self) -> None:
        # a mesh that does not tile the world fails here, before any process starts
        self._check_options_on_device(self._resolve_dims())
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        Strategy.setup_environment(self)  # the device; the mesh below, not ModelParallelStrategy's 2-D one
        # again: the cluster environment may have changed the world size
        self._build_mesh(self._resolve_dims())  # before the blocks compile (setup_module)

    # the Fabric(precision=...) choice as a D9DPrecisionBase (Fabric's property, typed as any plugin)
    precision = PrecisionSlot("_precision", as_fabric_precision, FabricPrecision)  # type: ignore[assignment,override]

    # -------------------------------------------------------------------------------------------- setup
    def parallel_options(self) -> ParallelOptions:
        return dataclasses.replace(self._options, mp_policy=self.precision.mixed_precision_policy())

    def _parallelize(self, module: nn.Module, _mesh: DeviceMesh) -> nn.Module:
        prepare.refuse_fsdp1(module)
        parallelize_once(module, lambda: self._parallelize_first(module))
        self.precision.autocast_device = autocast_device(module, self.root_device.type)
        return module

    def _parallelize_first(self, module: nn.Module) -> None:
        prepare.adapt(module, self._options)
        prepare.broadcast_plain_tensors(module, self.root_device, self.world_size)
        prepare.parallelize_root(module, self.parallel_dims, self.parallel_options())
        prepare.materialize(module, self.root_device, self.broadcast)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        # ModelParallelStrategy's, without its materialization (``_parallelize`` did it, from one seed)
        return self._parallelize(module, self.device_mesh)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # meta tensors get their memory after sharding (``_parallelize``)
        if not prepare.has_meta_tensors(module):
            module.to(self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """The optimizers were built on the model's parameters before sharding replaced them: each is given the
        parallel parameter of the same name."""
        names = {id(param): name for name, param in module.named_parameters()}
        for optimizer in optimizers:
            _check_rebindable(optimizer, names)
        module = self.setup_module(module)
        for optimizer in optimizers:
            _rebind(optimizer, names, module)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # (a loop of the user's accumulates as it likes: MasterWeightAdamW's docstring says why not to)
        check_master_weight_run(
            [optimizer],
            precision=self.precision.precision,
            autocast=self.precision.autocast_device is not None,
            accumulate=1,
            pipeline_degree=self.parallel_dims.pp,
        )
        return super().setup_optimizer(optimizer)

    # --------------------------------------------------------------------------------- loss, backward
    def model_loss(
        self, model: nn.Module, inputs: ModelInputs, target: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        """``loss_fn(model(*inputs), target)`` (``model(**inputs)`` for a dict) on this rank's part of the batch,
        weighed so that the mean over the data ranks is the global batch's (see ``D9DStrategy.model_loss``; no
        accumulation is counted here: a loop that accumulates divides by its micro-steps, as with any Fabric
        strategy)."""
        module = getattr(model, "_forward_module", model)  # a _FabricModule's: its forward context is below
        context = LossContext(self, forward_context=self.precision.forward_context)
        return compute_loss(module, inputs, target, loss_fn, context)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # the vocabulary-sharded cross-entropy's backward runs under loss_parallel too
        with vocab_parallel(self._dims):
            super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Over every gradient of every mesh (torch's own clip fails on DTensors of several meshes)."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer),
            float(max_norm),
            float(norm_type),
            error_if_nonfinite=error_if_nonfinite,
            scale_in_step=master_weight_scale(optimizer),
        )

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), float(clip_val))

    # ------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """The Trainer's checkpoint format (``lightning_d9d/fabric/checkpoint.py``): atomic, checksummed. Under LoRA
        the frozen base is left out and its fingerprint recorded instead (``state/frozen.py``), as the Trainer's
        strategy saves it."""
        if storage_options is not None:
            raise TypeError("D9DFabricStrategy.save_checkpoint(..., storage_options=...) is not supported")
        if filter is not None:
            raise NotImplementedError(
                "fabric.save(..., filter=...) is not supported by the d9d strategy: a sharded checkpoint is "
                "resumed whole; export weights with `python -m lightning_d9d.convert dcp-to-hf`"
            )
        directory = Path(self.broadcast(path))  # one path, rank 0's
        checkpoint = fabric_checkpoint.to_checkpoint(state)
        if self._options.lora is not None:
            model = fabric_checkpoint.split_state(state, action="save").model
            frozen = frozen_checkpoint.frozen_names(model)
            section = checkpoint[training_checkpoint.MODEL_SECTION]
            checkpoint[training_checkpoint.MODEL_SECTION] = {
                k: v for k, v in section.items() if k not in frozen
            }
            checkpoint[frozen_checkpoint.FINGERPRINT_KEY] = frozen_checkpoint.fingerprint(model)
            checkpoint[frozen_checkpoint.LORA_KEY] = frozen_checkpoint.lora_record(self._options.lora, model)
        training_checkpoint.save(directory, checkpoint)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load into ``state`` in place (any layout: DCP reshards) and return what the checkpoint holds beyond
        it. Every file is checked before the model is touched, on every rank alike. A LoRA checkpoint holds no
        frozen base: load the base weights into the model first (``lightning_d9d.state.hf.load_hf``); the load
        checks by fingerprint that they are the base the adapters were trained on, and refuses another by name."""
        if not state:
            raise ValueError(
                "fabric.load(path, state) under the d9d strategy needs the state to load into, with the model: "
                "{'model': model, 'optimizer': optimizer, ...}"
            )
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "fabric.load(path, optimizer) cannot load an optimizer without its model: pass "
                "{'model': model, 'optimizer': optimizer}"
            )
        directory = Path(self.broadcast(path))
        model = (
            state
            if isinstance(state, nn.Module)
            else fabric_checkpoint.split_state(state, action="load").model
        )
        # LoRA: the base the user loaded, fingerprinted on every rank (a collective) to check against the checkpoint's
        frozen = frozen_checkpoint.fingerprint(model) if self._options.lora is not None else None
        if isinstance(state, nn.Module):
            training_checkpoint.load(
                directory, state, {}, strict=strict, weights_only=weights_only, frozen=frozen
            )
            return {}
        values, remainder = fabric_checkpoint.load_into(
            directory, state, strict=strict, weights_only=weights_only, frozen=frozen
        )
        state.update(values)
        return remainder


def _check_rebindable(optimizer: Optimizer, names: dict[int, str]) -> None:
    """Before sharding: every parameter of ``optimizer`` is the model's, and it has not stepped yet."""
    if isinstance(optimizer, MasterWeightAdamW):
        raise ValueError(
            "MasterWeightAdamW takes its parameters' fp32 values as masters when it is built: build it over the "
            "set-up model instead (model = fabric.setup_module(model); optimizer = "
            "fabric.setup_optimizers(MasterWeightAdamW(model.parameters(), ...)))"
        )
    if optimizer.state and (not isinstance(optimizer, EagerState) or optimizer.has_stepped()):
        raise ValueError(
            f"{type(optimizer).__name__} has state already (it stepped): fabric.setup(model, optimizer) "
            "under the d9d strategy gives it the sharded parameters, which its state would not match; set it "
            "up before its first step"
        )
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that is not "
                    "the model's: fabric.setup(model, optimizer) needs an optimizer over the model's parameters"
                )


def _unwrapped_name(name: str) -> str:
    """A parameter's name without the modules that activation checkpointing and compile wrap blocks in."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _rebind(optimizer: Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer`` at the parameters that now stand under the same names in ``module``; an optimizer that
    built its state with itself (``StochasticAdamW``) builds it anew for them."""
    current = {_unwrapped_name(name): param for name, param in module.named_parameters()}
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = _unwrapped_name(names[id(param)])
            if name not in current:
                raise ValueError(
                    f"the parallel plan renamed the parameter {name!r}, so the optimizer cannot follow it: "
                    "set up the model first (model = fabric.setup_module(model)), then build the optimizer "
                    "over model.parameters() and set it up (fabric.setup_optimizers(optimizer))"
                )
            rebound.append(current[name])
        group["params"] = rebound
    if isinstance(optimizer, EagerState):
        optimizer.rebuild_state()
