"""Every private Lightning and torch name lightning_d9d depends on, in one place, and the tested versions.

A private name (a leading underscore, a module path with one, an undocumented internal or calling convention)
can change in any version. :data:`PRIVATE_NAMES` lists each one we use: where it lives, which of our files use
it, and why. Code reaches them only through this module (the typed aliases and helpers below);
``tests/test_compat.py`` pins the behaviour we rely on for every entry (its ``PINNED_BY``).

:func:`check_versions` runs when this module is first imported (``import lightning_d9d`` alone does not import
it): a missing required name raises :class:`PrivateAPIError` (an ``ImportError``) naming it, the installed and
the tested versions, before any process starts; torch or Lightning outside the tested range warns once. Most
entries are hooks Lightning calls or attributes it reads, which no call of ours would find missing, hence the
check at import. ``optional=True`` entries (optional features) are resolved where the feature runs.

A leaf module: it imports only Lightning and torch, so every layer may use it.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import DeviceMesh

# ------------------------------------------------------------------------------------------- versions
# Half-open ranges [low, high): pyproject.toml's dependency bounds (tests/test_compat.py checks).
TORCH_RANGE = ((2, 11), (2, 14))
LIGHTNING_RANGE = ((2, 6, 4), (2, 7))
TESTED = "torch 2.11 (GPU) and 2.13 (CPU), lightning 2.6.4 to 2.6.6"  # the whole suite ran on these
INSTALL_HINT = "pip install 'torch>=2.11,<2.14' 'lightning>=2.6.4,<2.7'"
TESTED_RANGES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "torch": TORCH_RANGE,
    "lightning": LIGHTNING_RANGE,
}


class PrivateAPIError(ImportError):
    """A private Lightning or torch name that lightning_d9d needs is missing from the installed version."""


class UntestedVersionWarning(UserWarning):
    """torch or Lightning is outside the range lightning_d9d was tested with."""


def installed_versions() -> dict[str, str]:
    return {"torch": str(torch.__version__), "lightning": str(lightning.__version__)}


def _version_numbers(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``"2.14.0.dev20260101"`` -> ``(2, 14, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read the version number {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def spell_range(bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    low, high = (".".join(map(str, bound)) for bound in bounds)
    return f">={low},<{high}"


def untested_versions(versions: Mapping[str, str] | None = None) -> list[str]:
    """``["torch 2.14.0 (tested: >=2.11,<2.14)"]`` for each package outside its tested range."""
    versions = installed_versions() if versions is None else versions
    untested = []
    for package, (low, high) in TESTED_RANGES.items():
        numbers = _version_numbers(versions[package])
        if not low <= numbers < high:
            untested.append(f"{package} {versions[package]} (tested: {spell_range((low, high))})")
    return untested


# ------------------------------------------------------------------------------------- private names
@dataclass(frozen=True)
class PrivateName:
    """One private name: ``module`` (importable) and ``path`` in it (``Class.attribute`` for attributes)."""

    module: str
    path: str
    users: tuple[str, ...]  # files under lightning_d9d/ (or examples/) that depend on it
    why: str
    instance: bool = (
        False  # set in ``__init__``, so not on the class: tests/test_compat.py checks an instance
    )
    optional: bool = False  # an optional feature's: resolved when the feature runs, not at import

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.path}"

    @property
    def library(self) -> str:
        return self.module.split(".")[0]

    def resolve(self) -> Any:
        """The object, or the class that owns it for an ``instance`` attribute; raises if it is missing."""
        obj: Any = importlib.import_module(self.module)
        parts = self.path.split(".")
        for part in parts[:-1] if self.instance else parts:
            obj = getattr(obj, part)
        return obj


_AUTOMATIC = "lightning.pytorch.loops.optimization.automatic"
_TRAINER_MP = "lightning.pytorch.strategies.model_parallel"
_FABRIC_MP = "lightning.fabric.strategies.model_parallel"
_CHECKPOINT_CALLBACK = "lightning.pytorch.callbacks.model_checkpoint"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"
_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_CP = "torch.distributed.tensor.experimental._attention"
_FUNCTIONAL = "torch.distributed._functional_collectives"
_PIPELINING = ("strategies/pipelining.py",)
_STRATEGY = ("strategies/d9d.py",)
_FABRIC = ("fabric/strategy.py",)
_MESH = ("strategies/topology.py",)  # the mesh both strategies build (their shared base)
_PUT_BACK = ("strategies/put_back.py",)
_TIMELINE = ("pipeline/timeline.py",)
_SELECTIVE = ("plans/checkpointing.py",)
_INIT_SEED = ("modules/init.py",)
_GLOO = ("mesh/parallel_dims.py",)

# A table, formatted by hand: the name, the files that use it, then why.
# fmt: off
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # ------------------------------------------------------------------ Lightning: the optimization loop
    PrivateName(_AUTOMATIC, "_AutomaticOptimization", _PIPELINING + _STRATEGY,
                "subclassed as ZeroGradFirstOptimization, swapped into the fit loop (__class__) each fit"),
    PrivateName(_AUTOMATIC, "_AutomaticOptimization._make_closure", _PIPELINING,
                "overridden to build the zero-grad-first closure; Lightning's run() must still call it"),
    PrivateName(_AUTOMATIC, "_AutomaticOptimization._make_step_fn", _PIPELINING, "wraps training_step"),
    PrivateName(_AUTOMATIC, "_AutomaticOptimization._make_backward_fn", _PIPELINING,
                "the strategy's backward"),
    PrivateName(_AUTOMATIC, "_AutomaticOptimization._make_zero_grad_fn", _PIPELINING,
                "zero_grad on the first micro-step of an accumulation window (None on the others)"),
    PrivateName(_AUTOMATIC, "Closure._step_fn", _PIPELINING,
                "ZeroGradFirstClosure re-orders the three callables Lightning's Closure holds",
                instance=True),
    PrivateName(_AUTOMATIC, "Closure._backward_fn", _PIPELINING, "as Closure._step_fn", instance=True),
    PrivateName(_AUTOMATIC, "Closure._zero_grad_fn", _PIPELINING, "as Closure._step_fn", instance=True),
    PrivateName("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate",
                ("examples/pretrain_qwen3.py",),
                "log only on optimizer steps, not on accumulation micro-steps"),
    # ------------------------------------------------------------------------- Lightning: the strategy
    PrivateName(_TRAINER_MP, "ModelParallelStrategy._setup_distributed", _MESH,
                "creates the process group; setup_environment builds our mesh after it"),
    PrivateName(_TRAINER_MP, "ModelParallelStrategy._configure_launcher", _STRATEGY,
                "overridden to reject a mesh that does not tile the world before any process is launched"),
    PrivateName("lightning.pytorch.strategies.strategy", "Strategy._launcher", _STRATEGY,
                "always set (put_back.py): its launch puts back interrupted checkpoints before "
                "ckpt_path='last' resolves",
                instance=True),
    PrivateName("lightning.pytorch.trainer.call", "_call_and_handle_interrupt", _PUT_BACK,
                "runs fit as launcher.launch(trainer_fn, *args, trainer=trainer, **kwargs): the put-back "
                "takes the trainer from that keyword"),
    PrivateName("lightning.pytorch.strategies.launchers.subprocess_script",
                "_SubprocessScriptLauncher.launch", _PUT_BACK,
                "ModelParallelStrategy's launcher: put_back_before_launch shadows its launch on the "
                "instance and calls it with the same arguments"),
    PrivateName(_CHECKPOINT_CALLBACK, "ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir", _PUT_BACK,
                "the folder Lightning lists for ckpt_path='last' (checkpoint_dir): the put-back looks there"),
    PrivateName(_TRAINER_MP, "ModelParallelStrategy._device_mesh", _MESH,
                "set to our 6-D mesh so Lightning's device_mesh users see it", instance=True),
    PrivateName(_TRAINER_MP, "ModelParallelStrategy._timeout", _MESH,
                "the collective timeout, handed to the mesh's groups", instance=True),
    PrivateName(_TRAINER_MP, "ModelParallelStrategy._save_distributed_checkpoint",
                ("strategies/checkpoint_hooks.py",),
                "the save_distributed_checkpoint flag: sharded DCP or one full file", instance=True),
    PrivateName("lightning.pytorch.strategies.strategy", "Strategy._precision_plugin", _STRATEGY,
                "backs the precision_plugin property (overridden: precision.PrecisionSlot), a D9DPrecision",
                instance=True),
    PrivateName("lightning.pytorch.core.module", "LightningModule._device_mesh", _STRATEGY,
                "backs LightningModule.device_mesh (set_module_device_mesh)", instance=True),
    PrivateName("lightning.pytorch.core.module", "LightningModule._trainer",
                ("strategies/loss.py", "strategies/d9d.py", "strategies/accumulation.py"),
                "model_loss and reduce() work outside a Trainer: .trainer raises there (trainer_of)",
                instance=True),
    # ---------------------------------------------------------------------------- Lightning: Fabric
    PrivateName(_FABRIC_MP, "ModelParallelStrategy._setup_distributed", _MESH,
                "creates the process group; setup_environment builds our mesh after it"),
    PrivateName(_FABRIC_MP, "ModelParallelStrategy._configure_launcher", _FABRIC,
                "overridden to reject a mesh that does not tile the world before any process is launched"),
    PrivateName(_FABRIC_MP, "ModelParallelStrategy._device_mesh", _MESH,
                "set to our 6-D mesh", instance=True),
    PrivateName(_FABRIC_MP, "ModelParallelStrategy._timeout", _MESH,
                "the collective timeout, handed to the mesh's groups", instance=True),
    PrivateName("lightning.fabric.strategies.strategy", "Strategy._precision", _FABRIC,
                "backs the precision property (overridden: precision.PrecisionSlot), a D9DPrecisionBase",
                instance=True),
    PrivateName("lightning.fabric.wrappers", "_FabricModule._forward_module", _FABRIC,
                "model_loss runs the set-up module itself, under the strategy's forward context",
                instance=True),
    # ------------------------------------------------------------------------ Lightning: callbacks
    PrivateName(_CHECKPOINT_CALLBACK, "ModelCheckpoint._link_checkpoint", ("strategies/async_save.py",),
                "replaced under async_save (replace_checkpoint_linker): Lightning links last.ckpt right "
                "after save_checkpoint returns, before a background save is complete"),
    # ---------------------------------------------------------------------------------------- torch
    PrivateName("torch.distributed.device_mesh", "DeviceMesh._flatten", _GLOO,
                "the flattened views (dp, fsdp, loss, ...) of the N-D mesh (flatten_mesh); no public API"),
    PrivateName("torch.distributed.device_mesh", "DeviceMesh._unflatten", ("modules/hybrid_attention.py",),
                "the cp mesh cut into head and key groups (unflatten_mesh); no public API"),
    PrivateName("torch.distributed", "ProcessGroup._get_backend", ("modules/hybrid_attention.py",),
                "the gloo backend of a group, whose options carry its collective timeout (unflatten_mesh)"),
    PrivateName("torch.distributed", "ProcessGroupGloo._Options", _GLOO,
                "the collective timeout of the mesh's own gloo groups (group_options)"),
    PrivateName("torch.distributed", "ProcessGroupGloo._Options._timeout", _GLOO,
                "the timeout field the Options carry to new_group (group_options)"),
    PrivateName(_SCHEDULES, "_Action", _TIMELINE, "one scheduled action, for the timeline", optional=True),
    PrivateName(_SCHEDULES, "_ComputationType", _TIMELINE,
                "F / B / I / W kinds of an _Action", optional=True),
    PrivateName("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", _TIMELINE,
                "torch's per-rank action order of a multi-stage schedule, for the timeline", optional=True),
    PrivateName(_STAGE, "PipelineStage._prepare_forward_infra", ("pipeline/runner.py",),
                "overridden to pause MoE load counting during torch's shape-inference forward on "
                "placeholder tensors"),
    PrivateName(_STAGE, "PipelineStage.perform_reduce_grad", ("pipeline/runner.py",),
                "overridden to hold FSDP gradient sync off on accumulation steps; torch's own switches sync "
                "on through the module's set_requires_gradient_sync, called through the instance "
                "(gradient_sync_held_off)"),
    PrivateName("torch._C", "_current_graph_task_id", ("modules/moe/router.py",),
                "-1 outside a backward: expert load is not counted again in a checkpoint recompute "
                "(in_backward_pass)"),
    PrivateName("torch.ops", "profiler._record_function_enter_new.default", _SELECTIVE,
                "a profiler range marker selective checkpointing must not count in its replay "
                "(profiler_range_ops)",
                optional=True),
    PrivateName("torch.ops", "profiler._record_function_exit._RecordFunction", _SELECTIVE,
                "the end of a profiler range, as profiler._record_function_enter_new.default", optional=True),
    PrivateName("torch.utils.checkpoint", "SAC_IGNORED_OPS", _SELECTIVE,
                "the (undocumented) ops selective checkpointing does not count; we add the profiler range "
                "markers (ignore_in_selective_replay)",
                optional=True),
    PrivateName(_CHECKPOINT_WRAPPER, "checkpoint_wrapper", _SELECTIVE,
                "activation checkpointing per block that keeps parameter names readable by DCP"),
    PrivateName(_CHECKPOINT_WRAPPER, "_CHECKPOINT_PREFIX", _INIT_SEED,
                "the name component checkpoint_wrapper adds; the init seed ignores it (WRAPPER_PREFIXES)"),
    PrivateName("torch.distributed.fsdp._common_utils", "FSDP_PREFIX", _INIT_SEED,
                "the name component FSDP1 adds; the init seed ignores it (WRAPPER_PREFIXES)"),
    PrivateName("torch._dynamo.eval_frame", "OptimizedModule._orig_mod", _INIT_SEED,
                "the name component torch.compile(module) adds; the init seed ignores it (WRAPPER_PREFIXES)",
                instance=True),
    PrivateName(_CP, "_enable_context_parallel_dispatcher", ("modules/context_attention.py",),
                "routes SDPA on sequence-sharded DTensors to torch's ring kernels (TorchRingAttention)"),
    PrivateName(_CP, "_cp_options", ("modules/context_attention.py",),
                "its enable_load_balance must be on: torch's ring then assumes our head-and-tail "
                "sequence layout"),
    PrivateName("torch.distributed.distributed_c10d", "_get_default_store", ("mesh/arrival.py",),
                "ranks mark their arrival at a collective in it, so a rank that never comes is named "
                "instead of hanging the collective (default_store)"),
    PrivateName("torch._inductor.config", "_micro_pipeline_tp", ("plans/async_tp.py",),
                "Inductor's micro-pipelined TP pass (async TP): a module flag, set as torchtitan does; "
                "no public switch",
                optional=True),
    PrivateName("torch.distributed._symmetric_memory", "enable_symm_mem_for_group", ("plans/async_tp.py",),
                "registers the tp group with CUDA symmetric memory, which async TP's fused matmuls need",
                optional=True),
    PrivateName("torchao.prototype.moe_training.fp8_grouped_mm", "_to_fp8_rowwise_then_scaled_grouped_mm",
                ("kernels/grouped_gemm_fp8.py",),
                "torchao's differentiable float8 rowwise grouped GEMM (as its MoE conversion and "
                "torchtitan call it), for the experts' torchao_fp8 backend; no public one",
                optional=True),
    PrivateName("torch.nn", "Module._apply", ("models/causal_lm.py",),
                "overridden to re-tie lm_head to the embedding after to_empty() / .to() replace parameters"),
    PrivateName("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
                ("optim/stochastic_rounding.py",),
                "where a DTensor's local part starts in the global tensor: StochasticAdamW hashes global "
                "element indices so that every layout rounds alike"),
    PrivateName("torch.distributed.tensor.placement_types", "_StridedShard",
                ("optim/stochastic_rounding.py", "plans/expert_tensor.py", "plans/memory.py", "state/boxes.py"),
                "the placement FSDP over tp gives a parameter's tp-sharded dim: its rows interleave, so "
                "StochasticAdamW indexes them through a table; expert-tensor parallelism's fused gate/up shard "
                "(each tp rank its part of the gate, then of the up), which the memory plan counts and DCP "
                "writes box by box"),
    PrivateName(_FUNCTIONAL, "all_to_all_single_autograd", ("modules/head_parallel_attention.py",),
                "an all-to-all with autograd (its backward the all-to-all back) that torch.compile traces: "
                "head-parallel attention's exchanges of heads and positions (all_to_all_autograd)"),
)
# fmt: on


def _tested_message(missing: list[PrivateName]) -> str:
    versions = installed_versions()
    lines = [
        f"  {entry.qualname} ({entry.library} {versions[entry.library]}), used by "
        f"{', '.join(entry.users)}: {entry.why}"
        for entry in missing
    ]
    return (
        "lightning_d9d depends on private Lightning/torch names that the installed versions do not have:\n"
        + "\n".join(lines)
        + f"\nInstalled: torch {versions['torch']}, lightning {versions['lightning']}. Tested: {TESTED}. "
        f"Fix: {INSTALL_HINT}"
    )


def missing_private_names(*, include_optional: bool = False) -> list[PrivateName]:
    """The entries of :data:`PRIVATE_NAMES` that do not resolve (instance attributes: their class only)."""
    missing = []
    for entry in PRIVATE_NAMES:
        if entry.optional and not include_optional:
            continue
        try:
            entry.resolve()
        except (ImportError, AttributeError):
            missing.append(entry)
    return missing


def import_private(module: str, path: str) -> Any:
    """The private name ``module.path``, which must be listed in :data:`PRIVATE_NAMES`; a missing one raises
    :class:`PrivateAPIError` naming every missing required name, the installed and the tested versions."""
    entry = next((e for e in PRIVATE_NAMES if (e.module, e.path) == (module, path)), None)
    if entry is None:
        raise LookupError(
            f"{module}.{path} is not listed in lightning_d9d.compat.PRIVATE_NAMES: add it there"
        )
    try:
        return entry.resolve()
    except (ImportError, AttributeError) as error:
        missing = missing_private_names() if not entry.optional else []
        raise PrivateAPIError(_tested_message(missing if entry in missing else [entry, *missing])) from error


def check_versions() -> None:
    """A readable error if a required private name is missing; a warning if torch or Lightning is outside the
    tested range (it may work; nothing has checked it)."""
    missing = missing_private_names()
    if missing:
        raise PrivateAPIError(_tested_message(missing))
    untested = untested_versions()
    if untested:
        warnings.warn(
            f"lightning_d9d is untested with {' and '.join(untested)}. It relies on private Lightning/torch "
            f"internals (lightning_d9d/compat.py), which may have changed. Tested: {TESTED}. To be safe: "
            f"{INSTALL_HINT}",
            UntestedVersionWarning,
            stacklevel=2,
        )


# ------------------------------------------------------------------------ the names, typed for mypy
if TYPE_CHECKING:
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization as AutomaticOptimization
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FSDPModule  # for an annotation only
else:
    AutomaticOptimization = import_private(_AUTOMATIC, "_AutomaticOptimization")
    checkpoint_wrapper = import_private(_CHECKPOINT_WRAPPER, "checkpoint_wrapper")

# Resolved once: in_backward_pass runs in every training forward of every router.
_current_graph_task_id = import_private("torch._C", "_current_graph_task_id")

# Name components that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1).
WRAPPER_PREFIXES: tuple[str, ...] = (
    import_private(_CHECKPOINT_WRAPPER, "_CHECKPOINT_PREFIX"),
    "_orig_mod.",  # an attribute of OptimizedModule, not a constant torch exports
    import_private("torch.distributed.fsdp._common_utils", "FSDP_PREFIX"),
)


# ----------------------------------------------------------------------- helpers over private names
def flatten_mesh(
    mesh: DeviceMesh, dims: str | tuple[str, ...], name: str, backend_override: Any | None = None
) -> DeviceMesh:
    """``mesh[dims]`` as one dimension called ``name``; ``backend_override``: ``(backend, options)`` for the
    group it makes (the collective timeout)."""
    return mesh[dims]._flatten(name, backend_override=backend_override)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D ``mesh`` cut into ``len(sizes)`` dims called ``names`` (the last the innermost: consecutive ranks of
    ``mesh``); on gloo the groups it makes take the collective timeout of ``mesh``'s own group, not gloo's
    default."""
    group = mesh.get_group()
    options = None
    if dist.get_backend(group) == "gloo":
        backend: Any = group._get_backend(torch.device(mesh.device_type))
        options = group_options(backend.options._timeout)
    override: Any = dict.fromkeys(names, options) if options is not None else None
    return mesh._unflatten(0, sizes, names, backend_override=override)


def trainer_of(module: LightningModule) -> Trainer | None:
    """The Trainer ``module`` is attached to, or None (``module.trainer`` raises outside a Trainer)."""
    trainer: Trainer | None = module._trainer
    return trainer


def set_module_device_mesh(module: LightningModule, mesh: DeviceMesh) -> None:
    """What ``module.device_mesh`` returns (Lightning sets it the same way in ModelParallelStrategy)."""
    module._device_mesh = mesh


def replace_checkpoint_linker(
    callback: ModelCheckpoint, link: Callable[[Trainer, str, str], None] | None
) -> None:
    """Make ``callback`` call ``link(trainer, target, link_path)`` where it links ``last.ckpt`` to its newest
    checkpoint (on this instance only); ``None`` gives it Lightning's back."""
    if link is None:
        vars(callback).pop("_link_checkpoint", None)
    else:
        vars(callback)["_link_checkpoint"] = link  # over the static method, for this instance only


def checkpoint_dir(callback: ModelCheckpoint, trainer: Trainer) -> str:
    """The folder in which ``callback`` looks for ``last.ckpt`` when a fit asks for ``ckpt_path="last"``."""
    resolve = import_private(_CHECKPOINT_CALLBACK, "ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir")
    return str(resolve(callback, trainer))


def should_accumulate(trainer: Trainer) -> bool:
    """True on an accumulation micro-step (no optimizer step after this batch)."""
    return bool(trainer.fit_loop._should_accumulate())


def use_automatic_optimization(trainer: Trainer, loop_class: type[AutomaticOptimization]) -> None:
    """Make the fit loop's automatic optimization an instance of ``loop_class`` (a subclass of Lightning's,
    adding no state): swapping ``__class__`` keeps the progress counters Lightning checkpoints."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    if not issubclass(loop_class, AutomaticOptimization):
        raise TypeError(f"{loop_class.__name__} must subclass Lightning's _AutomaticOptimization")
    loop.__class__ = loop_class


def schedule_ops(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> list[list[Any]]:
    """torch's per-rank ``_Action`` order of a multi-stage schedule (``None`` for idle slots)."""
    get_schedule_ops = import_private("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops")
    ops: list[list[Any]] = get_schedule_ops(schedule, pp, microbatches, stages_per_rank)
    return ops


def dtensor_global_offset(global_shape: Any, mesh: Any, placements: Any) -> tuple[int, ...]:
    """Where this rank's local part of a DTensor of ``global_shape`` starts (torch's own computation)."""
    compute = import_private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    _, offset = compute(global_shape, mesh, placements)
    return tuple(offset)


# Resolved once: head-parallel attention calls it in every layer, compiled blocks too.
_all_to_all_single_autograd = import_private(_FUNCTIONAL, "all_to_all_single_autograd")


def all_to_all_autograd(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor``'s dim 0 cut into as many equal blocks as ``group`` has ranks, block ``j`` sent to rank ``j``;
    returns the blocks received, rank ``i``'s as block ``i``. Differentiable: the backward sends each gradient
    block back where its block came from."""
    out: torch.Tensor = _all_to_all_single_autograd(tensor, None, None, group)
    return out


def strided_shard_type() -> Any:
    """torch's ``_StridedShard`` placement class (FSDP over tp), which is no ``Shard`` subclass."""
    return import_private("torch.distributed.tensor.placement_types", "_StridedShard")


def pipeline_action_types() -> tuple[Any, Any]:
    """torch's ``(_Action, _ComputationType)``, to build single-stage schedule orders for the timeline."""
    return import_private(_SCHEDULES, "_Action"), import_private(_SCHEDULES, "_ComputationType")


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward pass (as ``torch.utils.checkpoint`` tells it)."""
    return bool(_current_graph_task_id() != -1)


def profiler_range_ops() -> tuple[Any, ...]:
    """The ops ``record_function`` ranges call (enter, exit): they compute nothing."""
    return (
        import_private("torch.ops", "profiler._record_function_enter_new.default"),
        import_private("torch.ops", "profiler._record_function_exit._RecordFunction"),
    )


def ignore_in_selective_replay(ops: Collection[Any]) -> None:
    """Have selective checkpointing run ``ops`` without counting them in its replay (process-wide,
    idempotent)."""
    ignored: set[Any] = import_private("torch.utils.checkpoint", "SAC_IGNORED_OPS")
    ignored.update(ops)


@contextmanager
def gradient_sync_held_off(module: FSDPModule) -> Iterator[None]:
    """While inside, ``module.set_requires_gradient_sync(...)`` leaves gradient sync off whatever it is asked
    (an instance attribute shadows the class's method, which torch's ``perform_reduce_grad`` calls through the
    instance); the class's method is ``module``'s again afterwards."""
    switch = module.set_requires_gradient_sync

    def keep_off(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        switch(False, recurse=recurse)

    module.set_requires_gradient_sync = keep_off  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.set_requires_gradient_sync


def default_store() -> torch.distributed.Store:
    """The key-value store of the default process group (torch has no public accessor)."""
    get_default_store = import_private("torch.distributed.distributed_c10d", "_get_default_store")
    store: torch.distributed.Store = get_default_store()
    return store


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Turn on Inductor's micro-pipelined TP pass (process-wide) and register the process group ``group_name``
    with symmetric memory, as async TP needs."""
    import_private("torch._inductor.config", "_micro_pipeline_tp")  # fails readably where the flag is gone
    config: Any = importlib.import_module("torch._inductor.config")  # its flags are set as module attributes
    config._micro_pipeline_tp = True
    import_private("torch.distributed._symmetric_memory", "enable_symm_mem_for_group")(group_name)


def group_options(timeout: timedelta | None) -> tuple[str, Any] | None:
    """``("gloo", options)`` that give a new gloo group the collective ``timeout`` (``new_group`` would give
    it gloo's default, 30 minutes, not the default group's); None without a timeout or when the default group
    is not gloo. NCCL is left to torch: it splits the default group's communicator."""
    if (
        timeout is None
        or not dist.is_available()
        or not dist.is_initialized()
        or dist.get_backend() != "gloo"
    ):
        return None
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    return "gloo", options


# Every module relying on a private name imports this one first: check the versions before it runs.
check_versions()
