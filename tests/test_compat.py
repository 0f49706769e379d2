"""The private Lightning/torch names lightning_d9d depends on (``lightning_d9d/compat.py``) still exist and still
behave as we assume: the closure order above all, which no error would reveal if Lightning changed it."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d import compat
from lightning_d9d.fabric.checkpoint import Stateful
from lightning_d9d.strategies.optimizers import unwrap_optimizer
from lightning_d9d.strategies.pipelining import ZeroGradFirstClosure, ZeroGradFirstOptimization
from lightning_d9d.strategies.precision import DtypeContextManager, convert_fp_tensor
from lightning_d9d.strategies.put_back import DirectLauncher, checkpoint_folder

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------- every name resolves
@pytest.mark.parametrize("entry", compat.PRIVATE_NAMES, ids=lambda entry: entry.qualname)
def test_private_name_resolves(entry: compat.PrivateName) -> None:
    entry.resolve()


def _trainer() -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


# Instance attributes are set in __init__: build one instance of each owner to see them.
INSTANCES: dict[str, Callable[[], object]] = {
    "lightning.pytorch.loops.optimization.automatic.Closure": lambda: Closure(
        step_fn=lambda: ClosureResult(None)
    ),
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy": ModelParallelStrategy,
    "lightning.pytorch.strategies.strategy.Strategy": ModelParallelStrategy,
    "lightning.pytorch.core.module.LightningModule": L.LightningModule,
    "torch._dynamo.eval_frame.OptimizedModule": lambda: torch.compile(nn.Linear(2, 2), backend="eager"),
    "lightning.fabric.strategies.model_parallel.ModelParallelStrategy": lambda: FabricModelParallel(
        lambda module, mesh: module
    ),
    "lightning.fabric.strategies.strategy.Strategy": lambda: FabricModelParallel(lambda module, mesh: module),
    "lightning.fabric.wrappers._FabricModule": lambda: _FabricModule(
        nn.Linear(2, 2), FabricModelParallel(lambda module, mesh: module)
    ),
}


@pytest.mark.parametrize(
    "entry", [e for e in compat.PRIVATE_NAMES if e.instance], ids=lambda entry: entry.qualname
)
def test_instance_attribute_exists(entry: compat.PrivateName) -> None:
    owner, attribute = entry.qualname.rsplit(".", 1)
    assert owner in INSTANCES, f"add a factory for {owner} to INSTANCES"
    instance = INSTANCES[owner]()
    assert isinstance(instance, entry.resolve())
    assert hasattr(instance, attribute), f"{type(instance).__name__}() has no attribute {attribute}"


def test_every_listed_user_file_exists() -> None:
    for entry in compat.PRIVATE_NAMES:
        for user in entry.users:
            path = ROOT / user if user.startswith("examples/") else ROOT / "lightning_d9d" / user
            assert path.is_file(), (
                f"{entry.qualname}: user {user} does not exist; update compat.PRIVATE_NAMES"
            )


def _private_imports(path: Path) -> list[str]:
    """``module.name`` of every import of a private Lightning/torch name in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("torch", "lightning")
        ):
            private_module = any(part.startswith("_") for part in node.module.split("."))
            found += [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if private_module or (alias.name.startswith("_") and not alias.name.startswith("__"))
            ]
        elif isinstance(node, ast.Import):
            found += [
                alias.name
                for alias in node.names
                if alias.name.split(".")[0] in ("torch", "lightning")
                and any(part.startswith("_") for part in alias.name.split("."))
            ]
    return found


def test_private_names_are_imported_only_through_compat() -> None:
    files = [*(ROOT / "lightning_d9d").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    offenders = {
        str(path.relative_to(ROOT)): names
        for path in files
        if path.name != "compat.py" and (names := _private_imports(path))
    }
    assert not offenders, f"import these from lightning_d9d.compat (list them in PRIVATE_NAMES): {offenders}"


# --------------------------------------------------------------------------------------- closure order
def _recording_callables(log: list[str]) -> dict[str, Any]:
    loss = torch.tensor(1.0, requires_grad=True)

    def step_fn() -> ClosureResult:
        log.append("step")
        return ClosureResult(loss)

    def backward_fn(closure_loss: torch.Tensor) -> None:
        assert closure_loss is loss
        log.append("backward")

    def zero_grad_fn() -> None:
        log.append("zero_grad")

    return {"step_fn": step_fn, "backward_fn": backward_fn, "zero_grad_fn": zero_grad_fn}


def test_lightning_closure_zeroes_gradients_after_the_training_step() -> None:
    # Why ZeroGradFirstClosure exists: a pipeline schedule computes gradients inside training_step, and
    # Lightning's zero_grad after it would erase them. If this order changes, revisit pipelining.py.
    log: list[str] = []
    Closure(**_recording_callables(log))()
    assert log == ["step", "zero_grad", "backward"]


def test_zero_grad_first_closure_zeroes_before_the_training_step() -> None:
    log: list[str] = []
    result = ZeroGradFirstClosure(**_recording_callables(log))()
    assert log == ["zero_grad", "step", "backward"]
    assert result is not None and result.item() == 1.0


def test_zero_grad_first_closure_without_zero_grad_or_loss() -> None:
    log: list[str] = []
    callables = _recording_callables(log)
    ZeroGradFirstClosure(step_fn=callables["step_fn"], backward_fn=callables["backward_fn"])()
    assert log == ["step", "backward"]  # an accumulation micro-step: Lightning passes no zero_grad_fn

    log.clear()
    ZeroGradFirstClosure(step_fn=lambda: ClosureResult(None), backward_fn=callables["backward_fn"])()
    assert log == []  # training_step returned None: nothing to back-propagate


def test_make_closure_signature_is_the_one_we_override() -> None:
    lightning_params = list(inspect.signature(compat.AutomaticOptimization._make_closure).parameters)
    assert lightning_params == ["self", "kwargs", "optimizer", "batch_idx"]
    assert list(inspect.signature(ZeroGradFirstOptimization._make_closure).parameters) == lightning_params
    for factory, params in {
        "_make_step_fn": ["self", "kwargs"],
        "_make_backward_fn": ["self", "optimizer"],
        "_make_zero_grad_fn": ["self", "batch_idx", "optimizer"],
    }.items():
        assert list(inspect.signature(getattr(compat.AutomaticOptimization, factory)).parameters) == params


def _recording_loop(log: list[str], calls: list[tuple[Any, ...]]) -> ZeroGradFirstOptimization:
    """A ZeroGradFirstOptimization on a stand-in trainer whose fit loop is accumulating (no optimizer step)."""
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(handles_gradient_accumulation=False),
        fit_loop=SimpleNamespace(_should_accumulate=lambda: True),
    )
    loop = ZeroGradFirstOptimization(trainer)  # type: ignore[arg-type]
    callables = _recording_callables(log)

    def make(name: str, result: Any) -> Callable[..., Any]:
        def factory(*args: Any) -> Any:
            calls.append((name, *args))
            return result

        return factory

    loop._make_step_fn = make("step", callables["step_fn"])  # type: ignore[method-assign]
    loop._make_backward_fn = make("backward", callables["backward_fn"])  # type: ignore[method-assign]
    loop._make_zero_grad_fn = make("zero_grad", callables["zero_grad_fn"])  # type: ignore[method-assign]
    return loop


def test_lightning_run_builds_the_closure_through_make_closure() -> None:
    # Lightning's own run(), unchanged: it must call our _make_closure override, whose closure then runs
    # zero_grad -> training_step -> backward with the callables Lightning's factories build.
    log: list[str] = []
    calls: list[tuple[Any, ...]] = []
    loop = _recording_loop(log, calls)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    kwargs = OrderedDict(batch=torch.zeros(1), batch_idx=4)
    output = loop.run(optimizer, 4, kwargs)
    assert calls == [("step", kwargs), ("backward", optimizer), ("zero_grad", 4, optimizer)]
    assert log == ["zero_grad", "step", "backward"]
    assert output["loss"].item() == 1.0


def test_use_automatic_optimization_swaps_the_fit_loop_class_and_keeps_its_state() -> None:
    trainer = _trainer()
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    loop.optim_progress.optimizer.step.total.completed = 7
    compat.use_automatic_optimization(trainer, ZeroGradFirstOptimization)
    assert trainer.fit_loop.epoch_loop.automatic_optimization is loop
    assert type(loop) is ZeroGradFirstOptimization
    assert loop.optim_progress.optimizer.step.total.completed == 7
    with pytest.raises(TypeError, match="must subclass Lightning's _AutomaticOptimization"):
        compat.use_automatic_optimization(trainer, object)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ helpers
def test_attribute_helpers() -> None:
    module = L.LightningModule()
    assert compat.trainer_of(module) is None
    trainer = _trainer()
    module.trainer = trainer
    assert compat.trainer_of(module) is trainer

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert unwrap_optimizer(optimizer) is optimizer

    trainer.accumulate_grad_batches = 2
    trainer.fit_loop.epoch_loop.batch_progress.current.ready = 1  # the first of two micro-steps
    assert compat.should_accumulate(trainer) is True
    trainer.fit_loop.epoch_loop.batch_progress.current.ready = 2
    assert compat.should_accumulate(trainer) is False


def test_wrapper_prefixes_are_what_the_wrappers_insert() -> None:
    # As a block inside a model (the wrapper's own named_parameters() strips its prefix; the parent's does not).
    linear = nn.Linear(2, 2, bias=False)
    model = nn.Sequential(compat.checkpoint_wrapper(linear), torch.compile(linear, backend="eager"))
    assert [name for name, _ in model.named_parameters(remove_duplicate=False)] == [
        "0._checkpoint_wrapped_module.weight",
        "1._orig_mod.weight",
    ]
    assert compat.WRAPPER_PREFIXES == ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def test_dynamo_inlines_nn_modules_by_default() -> None:
    # plans/compile.py relies on it (one graph for all repeated blocks) without setting the flag (deprecated).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a deprecated flag warns on torch 2.13
        assert importlib.import_module("torch._dynamo").config.inline_inbuilt_nn_modules is True


def test_schedule_ops_of_a_multi_stage_schedule() -> None:
    action, computation_type = compat.pipeline_action_types()
    ops = compat.schedule_ops("Interleaved1F1B", 2, 2, 2)
    actions = [op for row in ops for op in row if op is not None]
    assert len(ops) == 2 and all(isinstance(op, action) for op in actions)
    # 2 ranks x 2 stages x 2 microbatches: each (stage, microbatch) has one forward and one backward.
    forwards = {
        (a.stage_index, a.microbatch_index) for a in actions if a.computation_type == computation_type.FORWARD
    }
    assert forwards == {(stage, mb) for stage in range(4) for mb in range(2)}


# ----------------------------------------------------------------------------- versions and messages
def test_installed_versions_are_tested_and_give_no_warning() -> None:
    assert compat.untested_versions() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions()


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ({"torch": "2.14.0", "lightning": "2.6.6"}, ["torch 2.14.0 (tested: >=2.11,<2.14)"]),
        ({"torch": "2.10.1+cu128", "lightning": "2.6.6"}, ["torch 2.10.1+cu128 (tested: >=2.11,<2.14)"]),
        ({"torch": "2.13.0+cpu", "lightning": "2.7.0"}, ["lightning 2.7.0 (tested: >=2.6.4,<2.7)"]),
        ({"torch": "2.11.0", "lightning": "2.6.3"}, ["lightning 2.6.3 (tested: >=2.6.4,<2.7)"]),
        ({"torch": "2.13.0.dev20260101", "lightning": "2.6.4"}, []),
        ({"torch": "2.11.0", "lightning": "2.6.6"}, []),
    ],
)
def test_untested_versions(versions: dict[str, str], expected: list[str]) -> None:
    assert compat.untested_versions(versions) == expected


def _reimport_compat() -> None:
    """Run ``compat`` again, as the first import of a module relying on private names does (``import
    lightning_d9d`` alone imports no Lightning: the check runs when compat is first imported)."""
    importlib.reload(compat)


def test_import_warns_about_an_untested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    monkeypatch.setattr(L, "__version__", "2.7.0")
    try:
        with pytest.warns(Warning) as caught:  # the re-run defines its warning class anew
            _reimport_compat()
    finally:
        monkeypatch.undo()
        _reimport_compat()
    (message,) = [str(w.message) for w in caught if w.category.__name__ == "UntestedVersionWarning"]
    assert (
        "untested with torch 2.14.1 (tested: >=2.11,<2.14) and lightning 2.7.0 (tested: >=2.6.4,<2.7)"
        in message
    )
    assert "pip install 'torch>=2.11,<2.14' 'lightning>=2.6.4,<2.7'" in message


def test_import_fails_readably_when_a_private_name_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization

    # A new Lightning without a name we rely on: the first module that needs compat fails, readably.
    monkeypatch.delattr(_AutomaticOptimization, "_make_closure")
    try:
        with pytest.raises(ImportError) as raised:
            _reimport_compat()
    finally:
        monkeypatch.undo()
        _reimport_compat()
    assert type(raised.value).__name__ == "PrivateAPIError"  # the class of the re-run that failed
    message = str(raised.value)
    lightning_version = compat.installed_versions()["lightning"]
    assert (
        f"_AutomaticOptimization._make_closure (lightning {lightning_version}), used by "
        "strategies/pipelining.py: overridden to build the zero-grad-first closure"
    ) in message
    assert f"Installed: torch {torch.__version__}, lightning {lightning_version}. " in message
    assert "Tested: torch 2.11 (GPU) and 2.13 (CPU), lightning 2.6.4 to 2.6.6" in message


def test_import_private_names_the_missing_name(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = compat.PrivateName(
        "torch.distributed.device_mesh", "DeviceMesh._flatten_v2", ("mesh/x.py",), "why"
    )
    monkeypatch.setattr(compat, "PRIVATE_NAMES", (*compat.PRIVATE_NAMES, gone))
    with pytest.raises(
        compat.PrivateAPIError, match=r"torch\.distributed\.device_mesh\.DeviceMesh\._flatten_v2 \(torch"
    ):
        compat.import_private("torch.distributed.device_mesh", "DeviceMesh._flatten_v2")
    with pytest.raises(LookupError, match=r"not listed in lightning_d9d\.compat\.PRIVATE_NAMES"):
        compat.import_private("torch.distributed.device_mesh", "DeviceMesh._unlisted")


def test_pyproject_bounds_are_the_tested_ranges() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert dependencies is not None
    specs = re.findall(r'"(torch|lightning)([<>=!~,.0-9]*)"', dependencies.group(1))
    assert dict(specs) == {
        "torch": ">=2.11,<2.14",
        "lightning": ">=2.6.4,<2.7",
    }
    assert compat.INSTALL_HINT == "pip install 'torch>=2.11,<2.14' 'lightning>=2.6.4,<2.7'"
    assert {name: compat.spell_range(bounds) for name, bounds in compat.TESTED_RANGES.items()} == dict(specs)


# ------------------------------------------------------------------- torch internals the helpers wrap
def test_in_backward_pass_is_true_only_while_autograd_runs_a_backward() -> None:
    # router.py counts the expert load only outside a backward pass: a forward inside one is a recompute.
    seen: list[tuple[str, bool]] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            seen.append(("Function.forward", compat.in_backward_pass()))
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(("Function.backward", compat.in_backward_pass()))
            return grad * 2

    def region(x: torch.Tensor) -> torch.Tensor:
        seen.append(("checkpointed forward", compat.in_backward_pass()))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    y = Probe.apply(x)
    y.register_hook(lambda grad: seen.append(("tensor hook", compat.in_backward_pass())))
    loss = torch.utils.checkpoint.checkpoint(region, y, use_reentrant=False).sum()
    seen.append(("before backward", compat.in_backward_pass()))
    loss.backward()
    seen.append(("after backward", compat.in_backward_pass()))
    assert sorted(seen) == sorted(  # the order of the backward's nodes is autograd's business
        [
            ("Function.forward", False),
            ("checkpointed forward", False),
            ("before backward", False),
            ("checkpointed forward", True),  # activation checkpointing's recompute
            ("tensor hook", True),
            ("Function.backward", True),
            ("after backward", False),
        ]
    )


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_profiler_range_ops_are_what_a_record_function_range_dispatches() -> None:
    x = torch.randn(3)
    with _RecordOps() as recorded, torch.profiler.record_function("a range"):
        x.sin()
    assert recorded.ops == [
        compat.profiler_range_ops()[0],
        torch.ops.aten.sin.default,
        compat.profiler_range_ops()[1],
    ]


def _recompute_enters_a_profiler_range(x: torch.Tensor) -> torch.Tensor:
    # As an FSDP unit's hooks inside a checkpointed block: the recompute opens a range the forward did not.
    if compat.in_backward_pass():
        with torch.profiler.record_function("recompute only"):
            pass
    return x.sin()


def _selective_backward(x: torch.Tensor) -> torch.Tensor:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    x = x.detach().requires_grad_()
    context_fn = partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, policy)
    out = torch.utils.checkpoint.checkpoint(
        _recompute_enters_a_profiler_range, x, use_reentrant=False, context_fn=context_fn
    )
    out.sum().backward()
    assert x.grad is not None
    return x.grad


def test_ignore_in_selective_replay_lets_the_replay_skip_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's set as it ships (other tests of this process may have added the range markers already)
    shipped = set(torch.utils.checkpoint.SAC_IGNORED_OPS) - set(compat.profiler_range_ops())
    ignored = set(shipped)
    monkeypatch.setattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ignored)
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match=r"_record_function_enter_new.*not found in storage"):
        _selective_backward(x)

    compat.ignore_in_selective_replay(compat.profiler_range_ops())
    assert torch.utils.checkpoint.SAC_IGNORED_OPS is ignored  # updated in place: torch reads this very set
    assert ignored == shipped | set(compat.profiler_range_ops())
    compat.ignore_in_selective_replay(compat.profiler_range_ops())
    assert ignored == shipped | set(compat.profiler_range_ops())  # idempotent
    torch.testing.assert_close(_selective_backward(x), x.cos())


class _SyncSwitch:
    """What gradient_sync_held_off needs of an FSDPModule: its set_requires_gradient_sync."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.calls.append((requires_gradient_sync, recurse))


def test_gradient_sync_held_off_keeps_sync_off_and_gives_the_method_back() -> None:
    module = _SyncSwitch()
    with compat.gradient_sync_held_off(module):  # type: ignore[arg-type]
        module.set_requires_gradient_sync(True)
        module.set_requires_gradient_sync(True, recurse=False)
    assert module.calls == [(False, True), (False, False)]
    assert "set_requires_gradient_sync" not in vars(module)  # the class's method again
    module.set_requires_gradient_sync(True)
    assert module.calls[-1] == (True, True)
    with pytest.raises(KeyError), compat.gradient_sync_held_off(module):  # type: ignore[arg-type]
        raise KeyError("a failed reduction")
    assert "set_requires_gradient_sync" not in vars(module)


def _reduce_grad_with_sync_held_off() -> tuple[bool, bool]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    module = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    module.set_requires_gradient_sync(
        False
    )  # an accumulation micro-step, as runner.AccumulatingStage sees it
    module(torch.randn(3, 4)).sum().backward()
    with compat.gradient_sync_held_off(module):
        stage.perform_reduce_grad(1)  # torch's: switches sync on through the instance, then reduces
    held_off = all(p.grad is None for p in module.parameters())  # nothing reduce-scattered
    stage.perform_reduce_grad(1)
    synced_after = all(p.grad is not None for p in module.parameters())
    return held_off, synced_after


def test_torch_perform_reduce_grad_honours_gradient_sync_held_off() -> None:
    from distributed import run_distributed

    ((held_off, synced_after),) = run_distributed(_reduce_grad_with_sync_held_off, 1)
    assert held_off, "torch's perform_reduce_grad reduced gradients while sync was held off"
    assert synced_after, "after gradient_sync_held_off, perform_reduce_grad no longer reduces"


# --------------------------------------------------------- private attributes we set, which Lightning reads
def test_lightning_reads_the_private_attributes_the_strategies_set() -> None:
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False, timeout=timedelta(seconds=77))
    assert strategy._save_distributed_checkpoint is False
    assert strategy._timeout == timedelta(seconds=77)
    launcher, mesh = object(), object()
    strategy._launcher = launcher  # type: ignore[assignment]
    strategy._device_mesh = mesh  # type: ignore[assignment]
    assert strategy.launcher is launcher
    assert strategy.device_mesh is mesh

    fabric_strategy = FabricModelParallel(lambda module, mesh: module, timeout=timedelta(seconds=78))
    assert fabric_strategy._timeout == timedelta(seconds=78)
    fabric_strategy._device_mesh = mesh  # type: ignore[assignment]
    assert fabric_strategy.device_mesh is mesh

    module = L.LightningModule()
    compat.set_module_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh

    forward_module = nn.Linear(2, 2)
    wrapped = _FabricModule(forward_module, fabric_strategy, original_module=nn.Linear(2, 2))
    assert wrapped._forward_module is forward_module  # the module the strategy set up, not the original


class _RecordingModelParallel(ModelParallelStrategy):
    configured: int = 0

    def _configure_launcher(self) -> None:
        type(self).configured += 1
        super()._configure_launcher()


class _RecordingFabricModelParallel(FabricModelParallel):
    configured: int = 0

    def _configure_launcher(self) -> None:
        type(self).configured += 1
        super()._configure_launcher()


def test_building_a_trainer_configures_the_launcher_and_takes_the_strategys_precision() -> None:
    # Where the strategies check the mesh before any process starts (_configure_launcher), and how the
    # precision they hold (_precision_plugin / _precision, set through their properties) reaches the run.
    strategy = _RecordingModelParallel()
    precision = HalfPrecision("bf16-true")
    strategy.precision_plugin = precision
    assert strategy._precision_plugin is precision
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False
    )
    assert _RecordingModelParallel.configured == 1
    assert trainer.strategy.precision_plugin is precision  # the connector reads _precision_plugin itself
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)

    fabric_strategy = _RecordingFabricModelParallel(lambda module, mesh: module)
    fabric_precision = FabricHalfPrecision("bf16-true")
    fabric_strategy.precision = fabric_precision
    assert fabric_strategy._precision is fabric_precision
    fabric = L.Fabric(strategy=fabric_strategy, accelerator="cpu", devices=1)
    assert _RecordingFabricModelParallel.configured == 1
    assert fabric.strategy.precision is fabric_precision


def _setup_distributed_makes_the_default_group() -> list[tuple[bool, str, timedelta]]:
    from distributed import free_port
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    results = []
    for strategy in (
        ModelParallelStrategy(timeout=timedelta(seconds=77)),
        FabricModelParallel(lambda module, mesh: module, timeout=timedelta(seconds=77)),
    ):
        dist.destroy_process_group()  # the launcher's group: _setup_distributed makes its own
        os.environ["MASTER_PORT"] = str(free_port())
        strategy.accelerator = CPUAccelerator()
        strategy.parallel_devices = [torch.device("cpu")]
        strategy.cluster_environment = LightningEnvironment()
        strategy._setup_distributed()
        results.append((dist.is_initialized(), dist.get_backend(), _group_timeout(None)))
    return results


def _group_timeout(group: Any) -> timedelta:
    group = group or dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[no-any-return]


def test_setup_distributed_makes_the_default_group_with_the_strategys_timeout() -> None:
    from distributed import run_distributed

    (results,) = run_distributed(_setup_distributed_makes_the_default_group, 1)
    assert results == [(True, "gloo", timedelta(seconds=77))] * 2


# ------------------------------------------------------------------- the put-back before Lightning's launch
def test_lightning_runs_fit_through_the_launcher_with_the_trainer() -> None:
    from lightning.pytorch.trainer.call import _call_and_handle_interrupt

    calls: list[tuple[Any, ...]] = []

    class Recording:
        def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            calls.append((function, args, kwargs))
            return function(*args, **{k: v for k, v in kwargs.items() if k != "trainer"})

    trainer = _trainer()
    trainer.strategy._launcher = Recording()  # type: ignore[assignment]

    def fit(step: int, *, ckpt_path: str) -> str:
        return f"{step} {ckpt_path}"

    assert _call_and_handle_interrupt(trainer, fit, 3, ckpt_path="last") == "3 last"
    assert calls == [(fit, (3,), {"trainer": trainer, "ckpt_path": "last"})]


def test_the_launchers_launch_takes_the_trainer_by_keyword() -> None:
    # put_back_before_launch shadows launch on the instance and calls Lightning's with what it was given.
    parameters = inspect.signature(_SubprocessScriptLauncher.launch).parameters
    assert [(name, p.kind) for name, p in parameters.items()] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("function", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("args", inspect.Parameter.VAR_POSITIONAL),
        ("trainer", inspect.Parameter.KEYWORD_ONLY),
        ("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
    assert list(inspect.signature(DirectLauncher.launch).parameters) == list(parameters)


@pytest.mark.parametrize(
    "setup",
    [
        "dirpath",
        "csv logger",
        "tensorboard-like logger, string version",
        "logger without save_dir",
        "no logger",
    ],
)
def test_the_put_back_looks_where_lightning_looks_for_last(tmp_path: Path, setup: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    logger: Any = False
    if setup == "csv logger":
        logger = CSVLogger(tmp_path / "logs", name="run", version=3)
    elif setup == "tensorboard-like logger, string version":
        logger = CSVLogger(tmp_path / "logs", name="run", version="v-seven")
    elif setup == "logger without save_dir":
        logger = SimpleNamespace(save_dir=None, name="run", version=2)
    callback = ModelCheckpoint(dirpath=tmp_path / "here" if setup == "dirpath" else None)
    trainer = SimpleNamespace(loggers=[logger] if logger else [], default_root_dir=str(tmp_path / "root"))
    folder = checkpoint_folder(callback, trainer)  # type: ignore[arg-type]
    assert folder is not None
    folder.mkdir(parents=True)
    (folder / "last.ckpt").touch()
    (folder / "last-v1.ckpt").touch()
    found = callback._find_last_checkpoints(trainer)  # type: ignore[arg-type]  # what ckpt_path="last" reads
    assert found == {os.path.normpath(folder / name) for name in ("last.ckpt", "last-v1.ckpt")}


def test_a_link_callback_calls_the_linker_we_replace(tmp_path: Path) -> None:
    # async_save replaces _link_checkpoint on a save_last="link" callback: Lightning must call it through the
    # instance, (trainer, target, link), where it links last.ckpt to the newest checkpoint.
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path, save_last="link")
    callback._last_checkpoint_saved = str(tmp_path / "step=3.ckpt")
    links: list[tuple[Any, str, str]] = []
    compat.replace_checkpoint_linker(callback, lambda *args: links.append(args))
    trainer = _trainer()
    callback._save_last_checkpoint(trainer, {})
    assert links == [(trainer, str(tmp_path / "step=3.ckpt"), str(tmp_path / "last.ckpt"))]
    compat.replace_checkpoint_linker(callback, None)
    assert "_link_checkpoint" not in vars(callback)  # Lightning's static method again


# ------------------------------------------------------------------ torch internals, on one gloo rank
def _mesh_views_and_timeouts() -> tuple[tuple[str, ...], int, timedelta, timedelta]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    options = compat.group_options(timedelta(seconds=123))
    flat = compat.flatten_mesh(mesh, ("a", "b"), "ab", options)
    plain = compat.flatten_mesh(mesh, ("a", "b"), "ab_default")
    names = flat.mesh_dim_names
    assert names is not None
    return names, flat.size(), _group_timeout(flat.get_group()), _group_timeout(plain.get_group())


def test_flatten_mesh_names_the_view_and_gives_its_group_the_timeout() -> None:
    from distributed import run_distributed

    ((names, size, timeout, default_timeout),) = run_distributed(_mesh_views_and_timeouts, 1)
    assert (names, size) == (("ab",), 1)
    assert timeout == timedelta(seconds=123)  # group_options' ProcessGroupGloo._Options._timeout
    assert default_timeout == timedelta(minutes=30)  # without it, torch's default: why group_options exists


def _unflattened_groups() -> list[tuple[list[list[int]], list[list[int]], timedelta, timedelta]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    with_timeout = compat.flatten_mesh(mesh, ("cp",), "cp_timed", compat.group_options(timedelta(seconds=77)))
    grid = compat.unflatten_mesh(with_timeout, (2, 2), ("outer", "inner"))
    return [
        (
            grid["inner"].mesh.view(1, -1).tolist(),
            grid["outer"].mesh.view(1, -1).tolist(),
            _group_timeout(grid["inner"].get_group()),
            _group_timeout(grid["outer"].get_group()),
        )
    ]


def test_unflatten_mesh_cuts_a_mesh_into_consecutive_and_strided_groups_with_its_timeout() -> None:
    """The hybrid head-parallel path's grid: the inner dim is consecutive ranks, the outer strided, and both groups
    keep the collective timeout of the mesh they were cut from (read through the group's gloo backend)."""
    from distributed import run_distributed

    ranks = run_distributed(_unflattened_groups, 4)
    inner = [rank[0][0] for rank in ranks]
    outer = [rank[0][1] for rank in ranks]
    assert inner == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert outer == [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]
    assert all(rank[0][2] == rank[0][3] == timedelta(seconds=77) for rank in ranks)


def _store_round_trip() -> str:
    store = compat.default_store()
    if dist.get_rank() == 0:
        store.set("arrived/0", "yes")
    dist.barrier()
    return store.get("arrived/0").decode()


def test_the_default_store_is_shared_by_the_ranks() -> None:
    from distributed import run_distributed

    assert run_distributed(_store_round_trip, 2) == ["yes", "yes"]


def _fsdp1_parameter_names() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NO_SHARD on one rank
        wrapped = FullyShardedDataParallel(
            nn.Sequential(nn.Linear(2, 2, bias=False)),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    return [name for name, _ in nn.Sequential(wrapped).named_parameters()]


def test_fsdp1_inserts_the_prefix_the_init_seed_ignores() -> None:
    from distributed import run_distributed

    (names,) = run_distributed(_fsdp1_parameter_names, 1)
    prefix = compat.WRAPPER_PREFIXES[2]
    assert names == [f"0.{prefix}0.{prefix}weight"]


def _forwards_by_phase() -> list[bool]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    inside: list[bool] = [False]
    forwards: list[bool] = []

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            forwards.append(inside[0])
            return super().forward(x)

    class Stage(PipelineStage):
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            inside[0] = True
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                inside[0] = False

    stage = Stage(Recording(3, 1), 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda output, target: (output - target).pow(2).mean())
    for _ in range(2):
        schedule.step(torch.randn(4, 3), target=torch.randn(4, 1))
    return forwards


def test_torch_infers_stage_shapes_inside_prepare_forward_infra() -> None:
    # runner.AccumulatingStage pauses MoE load counting there: torch's extra forward on the first step runs inside
    # it, and the 2 microbatches x 2 steps that train run outside it.
    from distributed import run_distributed

    (forwards,) = run_distributed(_forwards_by_phase, 1)
    assert forwards == [True, False, False, False, False]


def test_to_empty_and_to_go_through_the_root_modules_apply() -> None:
    # models/causal_lm.py re-ties its head in an _apply override: to_empty and .to must call the root's _apply.
    calls: list[bool] = []

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Root:
            calls.append(recurse)
            return super()._apply(fn, recurse)

    with torch.device("meta"):
        root = Root()
    root.to_empty(device="cpu")
    root.to(torch.float64)
    root.float()
    assert calls == [True, True, True]
    assert list(inspect.signature(nn.Module._apply).parameters) == ["self", "fn", "recurse"]


def test_torchs_context_parallel_switches() -> None:
    # TorchRingAttention checks enable_load_balance (our head-and-tail layout) and calls the dispatcher switch.
    cp = importlib.import_module("torch.distributed.tensor.experimental._attention")
    assert cp._cp_options.enable_load_balance is True  # torch's default, which our sequence layout needs
    assert list(inspect.signature(cp._enable_context_parallel_dispatcher).parameters) == []


def _exchange_blocks() -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    sent = (torch.arange(4.0) + 10 * rank).requires_grad_()  # block j (2 entries) goes to rank j
    received = compat.all_to_all_autograd(sent, dist.group.WORLD)
    (received * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    return received.tolist(), sent.grad.tolist()


def test_all_to_all_autograd_exchanges_blocks_and_sends_gradients_back() -> None:
    """Head-parallel attention's exchange: rank ``i``'s block ``j`` lands as rank ``j``'s block ``i``; each block's
    gradient returns to the rank and the place it came from."""
    from distributed import run_distributed

    (received_0, grad_0), (received_1, grad_1) = run_distributed(_exchange_blocks, 2)
    assert received_0 == [0.0, 1.0, 10.0, 11.0] and received_1 == [2.0, 3.0, 12.0, 13.0]
    # rank 0's block 0 was weighed by rank 0's (1, 2), its block 1 by rank 1's (1, 2)
    assert grad_0 == [1.0, 2.0, 1.0, 2.0] and grad_1 == [3.0, 4.0, 3.0, 4.0]


def test_async_tp_switches() -> None:
    inductor_config = importlib.import_module("torch._inductor.config")
    assert inductor_config._micro_pipeline_tp is False  # off unless async TP turns it on (a plain bool flag)
    symmetric_memory = importlib.import_module("torch.distributed._symmetric_memory")
    assert list(inspect.signature(symmetric_memory.enable_symm_mem_for_group).parameters) == ["group_name"]


def test_torchao_fp8_grouped_mm_takes_what_the_experts_pass() -> None:
    pytest.importorskip("torchao")
    function = compat.import_private(
        "torchao.prototype.moe_training.fp8_grouped_mm", "_to_fp8_rowwise_then_scaled_grouped_mm"
    )
    parameters = inspect.signature(function).parameters
    assert list(parameters)[:3] == ["A", "B_t", "offs"]  # positional: tokens, transposed weights, group ends
    assert {"out_dtype", "pad_token_groups_for_grouped_mm"} <= set(parameters)


# ------------------------------------------------------------------------- our own, instead of private names
def test_our_stand_ins_behave_as_the_private_names_they_replace() -> None:
    # Lightning's private _convert_fp_tensor, _DtypeContextManager and _Stateful, as our own beside their users.
    floats, ids = torch.ones(2), torch.ones(2, dtype=torch.int64)
    assert convert_fp_tensor(floats, torch.bfloat16).dtype == torch.bfloat16
    assert convert_fp_tensor(ids, torch.bfloat16) is ids
    before = torch.get_default_dtype()
    with DtypeContextManager(torch.bfloat16):
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before
    with pytest.raises(KeyError), DtypeContextManager(torch.float64):
        raise KeyError("a failed build")
    assert torch.get_default_dtype() == before
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))]), lambda s: 1.0
    )
    assert isinstance(scheduler, Stateful) and not isinstance({"step": 1}, Stateful)


def test_dtensor_offsets_and_the_strided_shard_are_what_stochastic_rounding_reads() -> None:
    """StochasticAdamW's global element index: torch's offset of a rank's shard (rank 2 of 4 on a fake process
    group: no peers needed), and ``_StridedShard`` as the placement FSDP over tp leaves on the tp-sharded dim (a
    placement class with a ``dim``, not a ``Shard``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=2, world_size=4, store=FakeStore())  # the autouse guard destroys it
    mesh = init_device_mesh("cpu", (4,))
    # torch.chunk's split of 10 rows over 4 ranks is (3, 3, 3, 1): rank 2's part starts at row 6
    assert compat.dtensor_global_offset((10, 3), mesh, (Shard(0),)) == (6, 0)
    placement = compat.strided_shard_type()(0, split_factor=2)
    assert placement.dim == 0 and not isinstance(placement, Shard)


# ------------------------------------------------------------------ every entry is pinned by a behaviour
# Which test pins the behaviour we rely on for each entry of PRIVATE_NAMES (beyond that the name exists).
PINNED_BY: dict[Callable[..., None], tuple[str, ...]] = {
    test_use_automatic_optimization_swaps_the_fit_loop_class_and_keeps_its_state: (
        "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization",
    ),
    test_lightning_run_builds_the_closure_through_make_closure: (
        "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization._make_closure",
    ),
    test_make_closure_signature_is_the_one_we_override: (
        "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization._make_step_fn",
        "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization._make_backward_fn",
        "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization._make_zero_grad_fn",
    ),
    test_zero_grad_first_closure_zeroes_before_the_training_step: (
        "lightning.pytorch.loops.optimization.automatic.Closure._step_fn",
        "lightning.pytorch.loops.optimization.automatic.Closure._backward_fn",
        "lightning.pytorch.loops.optimization.automatic.Closure._zero_grad_fn",
    ),
    test_attribute_helpers: (
        "lightning.pytorch.loops.fit_loop._FitLoop._should_accumulate",
        "lightning.pytorch.core.module.LightningModule._trainer",
    ),
    test_setup_distributed_makes_the_default_group_with_the_strategys_timeout: (
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._setup_distributed",
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._timeout",
        "lightning.fabric.strategies.model_parallel.ModelParallelStrategy._setup_distributed",
        "lightning.fabric.strategies.model_parallel.ModelParallelStrategy._timeout",
    ),
    test_building_a_trainer_configures_the_launcher_and_takes_the_strategys_precision: (
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._configure_launcher",
        "lightning.pytorch.strategies.strategy.Strategy._precision_plugin",
        "lightning.fabric.strategies.model_parallel.ModelParallelStrategy._configure_launcher",
        "lightning.fabric.strategies.strategy.Strategy._precision",
    ),
    test_lightning_reads_the_private_attributes_the_strategies_set: (
        "lightning.pytorch.strategies.strategy.Strategy._launcher",
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._device_mesh",
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy._save_distributed_checkpoint",
        "lightning.pytorch.core.module.LightningModule._device_mesh",
        "lightning.fabric.strategies.model_parallel.ModelParallelStrategy._device_mesh",
        "lightning.fabric.wrappers._FabricModule._forward_module",
    ),
    test_lightning_runs_fit_through_the_launcher_with_the_trainer: (
        "lightning.pytorch.trainer.call._call_and_handle_interrupt",
    ),
    test_the_launchers_launch_takes_the_trainer_by_keyword: (
        "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher.launch",
    ),
    test_the_put_back_looks_where_lightning_looks_for_last: (
        "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir",
    ),
    test_a_link_callback_calls_the_linker_we_replace: (
        "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._link_checkpoint",
    ),
    test_flatten_mesh_names_the_view_and_gives_its_group_the_timeout: (
        "torch.distributed.device_mesh.DeviceMesh._flatten",
        "torch.distributed.ProcessGroupGloo._Options",
        "torch.distributed.ProcessGroupGloo._Options._timeout",
    ),
    test_schedule_ops_of_a_multi_stage_schedule: (
        "torch.distributed.pipelining.schedules._Action",
        "torch.distributed.pipelining.schedules._ComputationType",
        "torch.distributed.pipelining._schedule_visualizer.get_schedule_ops",
    ),
    test_torch_infers_stage_shapes_inside_prepare_forward_infra: (
        "torch.distributed.pipelining.stage.PipelineStage._prepare_forward_infra",
    ),
    test_torch_perform_reduce_grad_honours_gradient_sync_held_off: (
        "torch.distributed.pipelining.stage.PipelineStage.perform_reduce_grad",
    ),
    test_in_backward_pass_is_true_only_while_autograd_runs_a_backward: ("torch._C._current_graph_task_id",),
    test_profiler_range_ops_are_what_a_record_function_range_dispatches: (
        "torch.ops.profiler._record_function_enter_new.default",
        "torch.ops.profiler._record_function_exit._RecordFunction",
    ),
    test_ignore_in_selective_replay_lets_the_replay_skip_the_ops: ("torch.utils.checkpoint.SAC_IGNORED_OPS",),
    test_wrapper_prefixes_are_what_the_wrappers_insert: (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX",
        "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
    ),
    test_fsdp1_inserts_the_prefix_the_init_seed_ignores: (
        "torch.distributed.fsdp._common_utils.FSDP_PREFIX",
    ),
    test_torchs_context_parallel_switches: (
        "torch.distributed.tensor.experimental._attention._enable_context_parallel_dispatcher",
        "torch.distributed.tensor.experimental._attention._cp_options",
    ),
    test_the_default_store_is_shared_by_the_ranks: ("torch.distributed.distributed_c10d._get_default_store",),
    test_async_tp_switches: (
        "torch._inductor.config._micro_pipeline_tp",
        "torch.distributed._symmetric_memory.enable_symm_mem_for_group",
    ),
    test_torchao_fp8_grouped_mm_takes_what_the_experts_pass: (
        "torchao.prototype.moe_training.fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm",
    ),
    test_to_empty_and_to_go_through_the_root_modules_apply: ("torch.nn.Module._apply",),
    test_dtensor_offsets_and_the_strided_shard_are_what_stochastic_rounding_reads: (
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
        "torch.distributed.tensor.placement_types._StridedShard",
    ),
    test_all_to_all_autograd_exchanges_blocks_and_sends_gradients_back: (
        "torch.distributed._functional_collectives.all_to_all_single_autograd",
    ),
    test_unflatten_mesh_cuts_a_mesh_into_consecutive_and_strided_groups_with_its_timeout: (
        "torch.distributed.device_mesh.DeviceMesh._unflatten",
        "torch.distributed.ProcessGroup._get_backend",
    ),
}


def test_every_private_name_is_pinned_by_a_behaviour_test() -> None:
    listed = {entry.qualname for entry in compat.PRIVATE_NAMES}
    pinned = {qualname for qualnames in PINNED_BY.values() for qualname in qualnames}
    assert pinned == listed, (
        f"pin these with a test of the behaviour we rely on: {sorted(listed - pinned)}; "
        f"no longer listed in compat.PRIVATE_NAMES: {sorted(pinned - listed)}"
    )
