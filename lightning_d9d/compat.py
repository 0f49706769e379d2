"""Every private Lightning and torch name lightning_d9d depends on, in one place, and the tested versions.

Private names (a leading underscore, or a module path with one; also a few undocumented internals such as
``torch.utils.checkpoint.SAC_IGNORED_OPS`` or ``PipelineStage.perform_reduce_grad``, and public methods we rely on
being called in a way torch does not document) can change in any release without notice. So:

- we avoid them where we can: a private type or two-line helper becomes our own (section "our own" below), a
  private attribute with a public accessor is read through it;
- :data:`PRIVATE_NAMES` lists each one we still use: where it lives, which of our files use it, and why; code
  imports them from here (typed aliases below) or calls the small helpers below, never Lightning or torch directly;
- ``tests/test_compat.py`` pins the behaviour we rely on for every entry, not only that the name exists;
- a missing name raises :class:`PrivateAPIError` (an ``ImportError``) naming the missing names, the installed
  versions and the tested ones.

:func:`check_versions` runs when this module is first imported (by the first of our modules that relies on a
private name; ``import lightning_d9d`` alone imports no Lightning): a missing required entry refuses the import, and
torch or Lightning outside the tested range warns once. Required entries are checked there, not where they are
used, because most are never "used" by our code: methods we override and attributes we set, which Lightning calls or
reads, or silently stops calling or reading; a run also fails before any process starts, not after its model is
built. Entries of optional features (``optional=True``) are resolved where the feature runs, and fail there.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.optim import Optimizer

# ------------------------------------------------------------------------------------------- versions
# Half-open ranges [low, high): the same bounds as pyproject.toml's dependencies (tests/test_compat.py checks).
TORCH_RANGE = ((2, 11), (2, 14))
LIGHTNING_RANGE = ((2, 6, 4), (2, 7))
# What "tested" means: the whole suite ran on these.
TESTED = "torch 2.11 (GPU) and 2.13 (CPU), lightning 2.6.4 to 2.6.6"
INSTALL_HINT = "pip install 'torch>=2.11,<2.14' 'lightning>=2.6.4,<2.7'"


class PrivateAPIError(ImportError):
    """A private Lightning or torch name that lightning_d9d needs is missing from the installed version."""


class UntestedVersionWarning(UserWarning):
    """torch or Lightning is outside the range lightning_d9d was tested with."""


def installed_versions() -> dict[str, str]:
    return {"torch": str(torch.__version__), "lightning": str(lightning.__version__)}


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``"2.14.0.dev20260101"`` -> ``(2, 14, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read the version number {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def spell_range(bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    low, high = (".".join(map(str, bound)) for bound in bounds)
    return f">={low},<{high}"


TESTED_RANGES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "torch": TORCH_RANGE,
    "lightning": LIGHTNING_RANGE,
}


def untested_versions(versions: Mapping[str, str] | None = None) -> list[str]:
    """``["torch 2.14.0 (tested: >=2.11,<2.14)"]`` for each package outside its tested range."""
    versions = installed_versions() if versions is None else versions
    untested = []
    for package, (low, high) in TESTED_RANGES.items():
        release = _release(versions[package])
        if not low <= release < high:
            untested.append(f"{package} {versions[package]} (tested: {spell_range((low, high))})")
    return untested


# ------------------------------------------------------------------------------------- private names
@dataclass(frozen=True)
class PrivateName:
    """One private name: ``module`` (importable) and ``path`` inside it (``Class.attribute`` for attributes)."""

    module: str
    path: str
    users: tuple[str, ...]  # files under lightning_d9d/ (or examples/) that depend on it
    why: str
    # An attribute that ``__init__`` sets, so not visible on the class: tests/test_compat.py checks an instance.
    instance: bool = False
    # Needed only by an optional feature (the schedule timeline, selective checkpointing): resolved when used, not
    # at import, so that a torch without it fails readably only when the feature is asked for.
    optional: bool = False

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
_PIPELINING = ("strategies/pipelining.py",)
_STRATEGY = ("strategies/d9d.py",)
_FABRIC = ("fabric/strategy.py",)
_MESH = ("strategies/topology.py",)  # the mesh both strategies build (their shared base)

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # ------------------------------------------------------------------ Lightning: the optimization loop
    PrivateName(
        _AUTOMATIC,
        "_AutomaticOptimization",
        _PIPELINING + _STRATEGY,
        "subclassed as ZeroGradFirstOptimization and swapped into the fit loop (its __class__) in every fit",
    ),
    PrivateName(
        _AUTOMATIC,
        "_AutomaticOptimization._make_closure",
        _PIPELINING,
        "overridden to build the zero-grad-first closure; Lightning's run() must still call it",
    ),
    PrivateName(_AUTOMATIC, "_AutomaticOptimization._make_step_fn", _PIPELINING, "wraps training_step"),
    PrivateName(
        _AUTOMATIC, "_AutomaticOptimization._make_backward_fn", _PIPELINING, "the strategy's backward"
    ),
    PrivateName(
        _AUTOMATIC,
        "_AutomaticOptimization._make_zero_grad_fn",
        _PIPELINING,
        "zero_grad on the first micro-step of an accumulation window (None on the others)",
    ),
    PrivateName(
        _AUTOMATIC,
        "Closure._step_fn",
        _PIPELINING,
        "ZeroGradFirstClosure re-orders the three callables Lightning's Closure holds",
        instance=True,
    ),
    PrivateName(_AUTOMATIC, "Closure._backward_fn", _PIPELINING, "as Closure._step_fn", instance=True),
    PrivateName(_AUTOMATIC, "Closure._zero_grad_fn", _PIPELINING, "as Closure._step_fn", instance=True),
    PrivateName(
        "lightning.pytorch.loops.fit_loop",
        "_FitLoop._should_accumulate",
        ("examples/pretrain_qwen3.py",),
        "log only on optimizer steps, not on accumulation micro-steps",
    ),
    # ------------------------------------------------------------------------- Lightning: the strategy
    PrivateName(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._setup_distributed",
        _MESH,
        "creates the process group; setup_environment builds our own mesh after it",
    ),
    PrivateName(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._configure_launcher",
        _STRATEGY,
        "overridden to reject a mesh that does not tile the world before any process is launched",
    ),
    PrivateName(
        "lightning.pytorch.strategies.strategy",
        "Strategy._launcher",
        _STRATEGY,
        "always set (strategies/put_back.py): its launch puts back interrupted checkpoints before Lightning "
        "resolves ckpt_path='last'",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.trainer.call",
        "_call_and_handle_interrupt",
        ("strategies/put_back.py",),
        "runs fit as strategy.launcher.launch(trainer_fn, *args, trainer=trainer, **kwargs): the put-back takes "
        "the trainer from that keyword",
    ),
    PrivateName(
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher.launch",
        ("strategies/put_back.py",),
        "the launcher ModelParallelStrategy makes; put_back_before_launch shadows its launch on the instance and "
        "calls it with the same arguments (function, *args, trainer=..., **kwargs)",
    ),
    PrivateName(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir",
        ("strategies/put_back.py",),
        "the folder ModelCheckpoint._find_last_checkpoints lists for ckpt_path='last' (checkpoint_dir): the "
        "put-back looks there",
    ),
    PrivateName(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._device_mesh",
        _MESH,
        "set to our 6-D mesh so Lightning's device_mesh users see it",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._timeout",
        _MESH,
        "the collective timeout, handed to the mesh's groups",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._save_distributed_checkpoint",
        ("strategies/checkpoint_hooks.py",),
        "the save_distributed_checkpoint flag: sharded DCP or one full file",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.strategies.strategy",
        "Strategy._precision_plugin",
        _STRATEGY,
        "the precision_plugin property is overridden (strategies/precision.PrecisionSlot) to store a D9DPrecision",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.core.module",
        "LightningModule._device_mesh",
        _STRATEGY,
        "backs LightningModule.device_mesh (set_module_device_mesh)",
        instance=True,
    ),
    PrivateName(
        "lightning.pytorch.core.module",
        "LightningModule._trainer",
        ("strategies/loss.py", "strategies/d9d.py", "strategies/accumulation.py"),
        "model_loss and reduce() work outside a Trainer: .trainer raises there (trainer_of)",
        instance=True,
    ),
    # ---------------------------------------------------------------------------- Lightning: Fabric
    PrivateName(
        "lightning.fabric.strategies.model_parallel",
        "ModelParallelStrategy._setup_distributed",
        _MESH,
        "creates the process group; setup_environment builds our own mesh after it",
    ),
    PrivateName(
        "lightning.fabric.strategies.model_parallel",
        "ModelParallelStrategy._configure_launcher",
        _FABRIC,
        "overridden to reject a mesh that does not tile the world before any process is launched",
    ),
    PrivateName(
        "lightning.fabric.strategies.model_parallel",
        "ModelParallelStrategy._device_mesh",
        _MESH,
        "set to our 6-D mesh",
        instance=True,
    ),
    PrivateName(
        "lightning.fabric.strategies.model_parallel",
        "ModelParallelStrategy._timeout",
        _MESH,
        "the collective timeout, handed to the mesh's groups",
        instance=True,
    ),
    PrivateName(
        "lightning.fabric.strategies.strategy",
        "Strategy._precision",
        _FABRIC,
        "the precision property is overridden (strategies/precision.PrecisionSlot) to store a D9DPrecisionBase",
        instance=True,
    ),
    PrivateName(
        "lightning.fabric.wrappers",
        "_FabricModule._forward_module",
        _FABRIC,
        "model_loss runs the set-up module itself, under the strategy's forward context",
        instance=True,
    ),
    # ------------------------------------------------------------------------ Lightning: callbacks
    PrivateName(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._link_checkpoint",
        ("strategies/async_save.py",),
        "replaced on a save_last='link' callback for the length of fit under async_save: Lightning calls it "
        "(trainer, target, link) right after save_checkpoint returns, before a background save is complete "
        "(replace_checkpoint_linker)",
    ),
    # ---------------------------------------------------------------------------------------- torch
    PrivateName(
        "torch.distributed.device_mesh",
        "DeviceMesh._flatten",
        ("mesh/parallel_dims.py",),
        "the flattened views (dp, fsdp, loss, ...) of the N-D mesh; torch has no public way yet (flatten_mesh)",
    ),
    PrivateName(
        "torch.distributed",
        "ProcessGroupGloo._Options",
        ("mesh/parallel_dims.py",),
        "the collective timeout of the mesh's own gloo groups (group_options; torch has no public Options)",
    ),
    PrivateName(
        "torch.distributed",
        "ProcessGroupGloo._Options._timeout",
        ("mesh/parallel_dims.py",),
        "the timeout field the Options carry to new_group (group_options)",
    ),
    PrivateName(
        "torch.distributed.pipelining.schedules",
        "_Action",
        ("pipeline/timeline.py",),
        "one scheduled action, for the schedule timeline",
        optional=True,
    ),
    PrivateName(
        "torch.distributed.pipelining.schedules",
        "_ComputationType",
        ("pipeline/timeline.py",),
        "F / B / I / W kinds of an _Action",
        optional=True,
    ),
    PrivateName(
        "torch.distributed.pipelining._schedule_visualizer",
        "get_schedule_ops",
        ("pipeline/timeline.py",),
        "torch's per-rank action order of a multi-stage schedule, for the timeline",
        optional=True,
    ),
    PrivateName(
        "torch.distributed.pipelining.stage",
        "PipelineStage._prepare_forward_infra",
        ("pipeline/runner.py",),
        "overridden to pause MoE load counting during torch's shape-inference forward on placeholder tensors",
    ),
    PrivateName(
        "torch.distributed.pipelining.stage",
        "PipelineStage.perform_reduce_grad",
        ("pipeline/runner.py",),
        "overridden to hold FSDP gradient sync off on accumulation steps (AccumulatingStage); torch's own switches "
        "sync on through the stage module's set_requires_gradient_sync, called through the instance, where "
        "gradient_sync_held_off shadows it",
    ),
    PrivateName(
        "torch._C",
        "_current_graph_task_id",
        ("modules/moe/router.py",),
        "-1 outside the autograd engine: the expert load is counted only outside a backward pass, so activation "
        "checkpointing's recompute does not count a forward again (in_backward_pass)",
    ),
    PrivateName(
        "torch.ops",
        "profiler._record_function_enter_new.default",
        ("plans/checkpointing.py",),
        "a profiler range marker that selective checkpointing must not count in its replay (profiler_range_ops)",
        optional=True,
    ),
    PrivateName(
        "torch.ops",
        "profiler._record_function_exit._RecordFunction",
        ("plans/checkpointing.py",),
        "the end of a profiler range, as profiler._record_function_enter_new.default",
        optional=True,
    ),
    PrivateName(
        "torch.utils.checkpoint",
        "SAC_IGNORED_OPS",
        ("plans/checkpointing.py",),
        "the ops selective checkpointing runs without counting them, updated in place with the profiler range "
        "markers (ignore_in_selective_replay); undocumented",
        optional=True,
    ),
    PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        ("plans/checkpointing.py",),
        "activation checkpointing per block that keeps parameter names readable by DCP",
    ),
    PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "_CHECKPOINT_PREFIX",
        ("modules/init.py",),
        "the name component checkpoint_wrapper adds; the init seed ignores it (WRAPPER_PREFIXES)",
    ),
    PrivateName(
        "torch.distributed.fsdp._common_utils",
        "FSDP_PREFIX",
        ("modules/init.py",),
        "the name component FSDP1 adds; the init seed ignores it (WRAPPER_PREFIXES)",
    ),
    PrivateName(
        "torch._dynamo.eval_frame",
        "OptimizedModule._orig_mod",
        ("modules/init.py",),
        "the name component torch.compile(module) adds; the init seed ignores it (WRAPPER_PREFIXES)",
        instance=True,
    ),
    PrivateName(
        "torch.distributed.tensor.experimental._attention",
        "_enable_context_parallel_dispatcher",
        ("modules/context_attention.py",),
        "routes SDPA on sequence-sharded DTensors to torch's ring kernels (TorchRingAttention, CUDA)",
    ),
    PrivateName(
        "torch.distributed.tensor.experimental._attention",
        "_cp_options",
        ("modules/context_attention.py",),
        "its enable_load_balance must be on: torch's ring then assumes our head-and-tail sequence layout",
    ),
    PrivateName(
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        ("mesh/arrival.py",),
        "the default process group's key-value store: ranks mark their arrival at a collective in it, so a "
        "rank that never comes is named instead of hanging the collective",
    ),
    PrivateName(
        "torch._inductor.config",
        "_micro_pipeline_tp",
        ("plans/async_tp.py",),
        "Inductor's micro-pipelined TP pass (async TP), a module-level flag torchtitan sets the same way; no public "
        "switch",
        optional=True,
    ),
    PrivateName(
        "torch.distributed._symmetric_memory",
        "enable_symm_mem_for_group",
        ("plans/async_tp.py",),
        "registers the tp group with CUDA symmetric memory, which the fused all-gather / reduce-scatter matmuls "
        "of async TP need",
        optional=True,
    ),
    PrivateName(
        "torchao.prototype.moe_training.fp8_grouped_mm",
        "_to_fp8_rowwise_then_scaled_grouped_mm",
        ("kernels/grouped_gemm_fp8.py",),
        "torchao's float8 rowwise grouped GEMM for MoE training (differentiable; the function torchao's own MoE "
        "conversion and torchtitan call), for the experts' torchao_fp8 backend; torchao exports no public one",
        optional=True,
    ),
    PrivateName(
        "torch.nn",
        "Module._apply",
        ("models/causal_lm.py",),
        "overridden to re-tie lm_head to the embedding after to_empty() / .to() replace parameters",
    ),
)


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
    """The private name ``module.path``, which must be listed in :data:`PRIVATE_NAMES`.

    Raises :class:`PrivateAPIError` naming every missing required name (not only this one), the installed and
    the tested versions."""
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
    """Called when this module is first imported: a readable error if a required private name is missing, a
    warning if torch or Lightning is outside the tested range (it may work; nothing has checked it)."""
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
    checkpoint_wrapper = import_private(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"
    )


# ------------------------------------------------------- our own, where a private name was only a convenience
# Types and two-line helpers that Lightning or torch keep private are defined here instead of imported: nothing
# to pin. mypy checks the types against Lightning's signatures where they meet (the hooks we override).
FilePath: TypeAlias = str | Path
"""A checkpoint path, as Lightning's strategy hooks take it."""

# Every torch schedule is one of the two (both derive from torch's private ``_PipelineSchedule``).
PipelineSchedule: TypeAlias = PipelineScheduleSingle | PipelineScheduleMulti


class StrategyRegistryType(Protocol):
    """What ``register_strategies`` uses of the registry Lightning hands it (a dict of names)."""

    def __contains__(self, name: object, /) -> bool: ...

    def register(
        self,
        name: str,
        strategy: Callable[..., Any] | None = None,
        description: str | None = None,
        override: bool = False,
        **init_params: Any,
    ) -> Callable[..., Any]: ...


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint saves as its ``state_dict()`` and restores in place (a scheduler), as Fabric tells it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def convert_fp_tensor(tensor: torch.Tensor, dst_type: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dst_type`` if it is floating point; other tensors (token ids, masks) as they are."""
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


class DtypeContextManager:
    """torch's default dtype is ``dtype`` inside (tensors and modules created there take it)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self._previous = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc_info: object) -> None:
        torch.set_default_dtype(self._previous)


# Resolved once: in_backward_pass runs in every training forward of every router.
_current_graph_task_id = import_private("torch._C", "_current_graph_task_id")

# Name components that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1).
WRAPPER_PREFIXES: tuple[str, ...] = (
    import_private("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_PREFIX"),
    "_orig_mod.",  # an attribute of OptimizedModule, not a constant torch exports (pinned by tests/test_compat.py)
    import_private("torch.distributed.fsdp._common_utils", "FSDP_PREFIX"),
)


# --------------------------------------------------------------------- helpers for attribute accesses
def flatten_mesh(
    mesh: DeviceMesh, dims: str | tuple[str, ...], name: str, backend_override: Any | None = None
) -> DeviceMesh:
    """``mesh[dims]`` as one dimension called ``name`` (``DeviceMesh._flatten``: torch has no public API yet);
    ``backend_override``: ``(backend, options)`` for the group it makes (the collective timeout)."""
    return mesh[dims]._flatten(name, backend_override=backend_override)


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


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
    checkpoint (``save_last="link"``: the static ``_link_checkpoint``, replaced on this instance only); ``None``
    gives it Lightning's back."""
    if link is None:
        vars(callback).pop("_link_checkpoint", None)
    else:
        vars(callback)["_link_checkpoint"] = link  # over the static method, for this instance only


def checkpoint_dir(callback: ModelCheckpoint, trainer: Trainer) -> str:
    """The folder in which ``callback`` looks for ``last.ckpt`` when a fit asks for ``ckpt_path="last"`` (its
    ``dirpath``, else one under the first logger's or the trainer's root): Lightning's own resolution, a
    name-mangled method of ``ModelCheckpoint``."""
    resolve = import_private(
        "lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir"
    )
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


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward pass (as ``torch.utils.checkpoint`` tells it: the current
    graph task id is -1 outside one)."""
    return bool(_current_graph_task_id() != -1)


def profiler_range_ops() -> tuple[Any, ...]:
    """The ops ``record_function`` ranges call (enter, exit): they compute nothing."""
    return (
        import_private("torch.ops", "profiler._record_function_enter_new.default"),
        import_private("torch.ops", "profiler._record_function_exit._RecordFunction"),
    )


def ignore_in_selective_replay(ops: Collection[Any]) -> None:
    """Have selective checkpointing run ``ops`` without counting them in its replay (process-wide, idempotent:
    torch's ``SAC_IGNORED_OPS``, a module-level set, is updated in place)."""
    ignored: set[Any] = import_private("torch.utils.checkpoint", "SAC_IGNORED_OPS")
    ignored.update(ops)


@contextmanager
def gradient_sync_held_off(module: FSDPModule) -> Iterator[None]:
    """While inside, ``module.set_requires_gradient_sync(...)`` leaves gradient sync off whatever it is asked:
    an instance attribute shadows the class's method (torch's ``PipelineStage.perform_reduce_grad`` switches sync
    on through the instance). The class's method is ``module``'s again afterwards."""
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
    store: torch.distributed.Store = import_private(
        "torch.distributed.distributed_c10d", "_get_default_store"
    )()
    return store


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Turn on Inductor's micro-pipelined TP pass (process-wide) and register the process group ``group_name``
    with symmetric memory, as async TP needs."""
    import_private("torch._inductor.config", "_micro_pipeline_tp")  # fails readably where the flag is gone
    config: Any = importlib.import_module("torch._inductor.config")  # its flags are set as module attributes
    config._micro_pipeline_tp = True
    import_private("torch.distributed._symmetric_memory", "enable_symm_mem_for_group")(group_name)


def pipeline_action_types() -> tuple[Any, Any]:
    """torch's ``(_Action, _ComputationType)``, to build single-stage schedule orders for the timeline."""
    schedules = "torch.distributed.pipelining.schedules"
    return import_private(schedules, "_Action"), import_private(schedules, "_ComputationType")


def group_options(timeout: timedelta | None) -> tuple[str, Any] | None:
    """``("gloo", options)`` that give a new gloo process group the collective ``timeout``; None when there is no
    timeout to pass on or the default group is not gloo. torch's ``new_group`` would otherwise give each gloo mesh
    group its own default timeout (30 minutes), not the default group's. NCCL is left to torch (it splits the
    default group's communicator; passing NCCL options there is untested here, with no GPUs to test it on)."""
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
