"""Run ``Trainer(strategy=D9DStrategy(...))`` on the example module and save what the tests compare.

Launched by the tests as ``python trainer_script.py '<json config or list of configs>'`` (torchrun starts the
ranks, or Lightning's launcher re-executes the same command line for them), or as ``python trainer_script.py
--fork '<json list of configs>'``, which forks the ranks itself (``fork_ranks``). Rank 0 writes
``{"losses", "params", "val_loss"}`` to ``config["out"]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import noop_context_fn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared launch helpers
from distributed import LIBC_CRASHES, free_port, set_torchrun_environment
from plain_module import build_plain_model
from pretrain_qwen3 import Qwen3Pretraining
from reference import exclude_experts, freeze, train_corpus, uncounted_loss, use_optimizer, val_corpus

from lightning_d9d import D9DStrategy, LoRA
from lightning_d9d.callbacks import preemption as preemption_callback
from lightning_d9d.callbacks.moe import ExpertLoadBalancing
from lightning_d9d.callbacks.preemption import Preemption
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, causal_lm
from lightning_d9d.pipeline.tied import is_tied_copy
from lightning_d9d.state.selection import incomplete_reason, looks_like_checkpoint

# How often the fused LM head + loss ran (causal_lm.head_loss: CausalLM.forward_loss, or a last pipeline stage
# handed the labels), for the tests that force it.
FUSED_LOSS_CALLS = [0]
_head_loss = causal_lm.head_loss


def _counted_head_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    FUSED_LOSS_CALLS[0] += 1
    return _head_loss(*args, **kwargs)


causal_lm.head_loss = _counted_head_loss


class RecordLosses(Callback):
    """The loss of every micro-batch, averaged over all ranks by ``self.log(..., sync_dist=True)``."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


class RecordGradNorms(Callback):
    """The global gradient norm before clipping, on every optimizer step, computed without the strategy's
    clipping code: each gradient's squares summed whole (``square_sums``), and under pp every parameter counted
    once."""

    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        squares = square_sums(
            {
                plain_name(name): p.grad
                for name, p in pl_module.named_parameters()
                if p.grad is not None and not is_tied_copy(p)  # a weight tied across pipeline ranks: once
            }
        )
        if self.pipelined:
            # each pipeline rank holds other layers; dp replicas of a stage report the same names and values
            gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, squares)
            squares = {name: value for part in gathered for name, value in part.items()}
        self.norms.append(sum(squares.values()) ** 0.5)


class RecordGrads(Callback):
    """Every parameter's whole gradient on every optimizer step, before clipping (under pp gathered from the
    ranks that hold it), by name: to compare with the reference's gradients, which no optimizer has amplified
    (AdamW's division by ``sqrt(v) + eps`` scales a near-zero gradient's rounding noise up to ~lr)."""

    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        grads = {
            plain_name(name): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            .float()
            .clone()
            for name, p in pl_module.named_parameters()
            if p.grad is not None
        }
        if self.pipelined:
            gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, grads)
            grads = {name: grad for part in gathered for name, grad in part.items()}
        self.grads.append(grads)


def square_sums(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each whole gradient's sum of squares (float64), by name. A DTensor's local squares are summed over the
    mesh dims it is sharded on, one all-reduce per (mesh, dims) group rather than a ``full_tensor`` per
    parameter (which made this callback a third of a run); a partial sum is made whole first."""
    squares: dict[str, float] = {}
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, grad in grads.items():
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            grad = grad.full_tensor()
        if not isinstance(grad, DTensor):
            squares[name] = float(grad.double().square().sum())
            continue
        # Shard and _StridedShard (FSDP over tp shards; its is_shard() is False)
        sharded = tuple(dim for dim, p in enumerate(grad.placements) if not p.is_replicate())
        local = grad.to_local().double().square().sum()
        groups.setdefault((grad.device_mesh, sharded), []).append((name, local))
    for (mesh, sharded), parts in groups.items():
        values = torch.stack([value for _, value in parts])
        for dim in sharded:
            dist.all_reduce(values, group=mesh.get_group(dim))
        squares.update(zip([name for name, _ in parts], values.tolist(), strict=True))
    return squares


class _RecordOps(TorchDispatchMode):
    def __init__(self, ops: set[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _recording_below(ops: set[str], recompute: Any) -> Iterator[None]:
    # Entered before (below) the checkpoint's own recompute mode: selective checkpointing hands back the saved
    # outputs of the ops it kept without calling them, so only the ops that really ran again reach the recorder.
    with _RecordOps(ops), recompute:
        yield


class RecordRecompute(Callback):
    """The aten ops that activation checkpointing's recompute ran in backward, as ``"aten.mm.default"``: each
    checkpoint wrapper's ``context_fn`` (selective checkpointing's policy, or none under full) gains a recorder."""

    def __init__(self) -> None:
        self.ops: set[str] = set()

    def _contexts(self, context_fn: Any) -> tuple[Any, Any]:
        forward, recompute = context_fn()
        return forward, _recording_below(self.ops, recompute)

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        for module in pl_module.modules():
            if hasattr(module, "_checkpoint_wrapped_module"):
                fn = module.checkpoint_fn
                context_fn = partial(self._contexts, fn.keywords.get("context_fn", noop_context_fn))
                module.checkpoint_fn = partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": context_fn})


class ExcludeExperts(Callback):
    """Give ``experts`` a selection bias no token overcomes, after the strategy initialised the routers."""

    def __init__(self, experts: list[int]) -> None:
        self.experts = experts

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        exclude_experts(pl_module, self.experts)


class SignalAt(Callback):
    """Send this process ``signal`` (SIGUSR1) on rank ``rank`` during optimizer step ``step`` (1-based, as
    ``global_step`` counts it after the step), at ``at``: the batch's start, before its backward, or before the
    optimizer step."""

    def __init__(self, rank: int, step: int, at: str) -> None:
        self.rank, self.step, self.at = rank, step, at

    def _maybe(self, trainer: L.Trainer, where: str) -> None:
        if where == self.at and trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._maybe(trainer, "batch_start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # type: ignore[no-untyped-def]
        self._maybe(trainer, "backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self._maybe(trainer, "optimizer")


class KillAt(Callback):
    """SIGKILL every rank after optimizer step ``step`` (a crash: no handler, no cleanup); rank 0 first writes
    ``{"killed_at": step}`` to ``out``, the run's only result."""

    def __init__(self, step: int, out: str) -> None:
        self.step, self.out = step, out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            if trainer.is_global_zero:
                torch.save({"killed_at": self.step}, self.out)
            os.kill(os.getpid(), signal.SIGKILL)


class RequeueEndsTheJob(Callback):
    """A stand-in for Preemption's ``scontrol requeue`` (rank 0 runs it): SLURM then sends SIGTERM to every task
    of the job and SIGKILL once its KillWait has passed, here at once, so that nothing after the requeue can
    complete a checkpoint. Rank 0 first writes ``{"preempted": the callback's saved path, "global_step"}`` to
    ``out``, the run's only result."""

    def __init__(self, preemption: Preemption, out: str) -> None:
        self.preemption, self.out = preemption, out
        self.pids: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.pids = [os.getpid()]
        if dist.is_initialized():
            self.pids = [0] * dist.get_world_size()
            dist.all_gather_object(self.pids, os.getpid())
        preemption_callback._requeue = self.requeue  # for the rest of the process: it ends in the requeue

    def requeue(self, trainer: L.Trainer) -> None:
        saved = self.preemption.saved
        torch.save({"preempted": str(saved) if saved else None, "global_step": trainer.global_step}, self.out)
        others = [pid for pid in self.pids if pid != os.getpid()]
        for pid in others:
            os.kill(pid, signal.SIGTERM)
        for pid in others:
            os.kill(pid, signal.SIGKILL)
        # SIGKILL alone here: a SIGTERM would first run Lightning's handler in this thread, whose broadcast
        # waits for ranks that are gone
        os.kill(os.getpid(), signal.SIGKILL)


class RecordFolder(Callback):
    """At every batch start (before the strategy's hook, which may complete a background save), rank 0 notes
    the complete checkpoints in ``folder``: names, sorted, a link as ``"last.ckpt->step=3.ckpt"``. What a crash
    at that moment would leave to resume from."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.is_global_zero:
            self.seen.append(complete_checkpoints(self.folder))


def complete_checkpoints(folder: Path) -> list[str]:
    """The complete checkpoints directly in ``folder`` (hidden temporary directories are none), sorted by name,
    a link shown with its target."""
    if not folder.is_dir():
        return []
    return sorted(
        entry.name + (f"->{os.readlink(entry)}" if entry.is_symlink() else "")
        for entry in folder.iterdir()
        if not entry.name.startswith(".")
        and looks_like_checkpoint(entry)
        and incomplete_reason(entry) is None
    )


def slow_down_writes_of(marker: str, seconds: float) -> None:
    """Make DCP's file writes into directories whose name holds ``marker`` take ``seconds`` longer (the
    background write of an async save is then still running when the test kills the ranks). For the rest of
    the process: give such a config a launch of its own."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def slow(self, plan, planner):  # type: ignore[no-untyped-def]
        if marker in str(self.path):
            time.sleep(seconds)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = slow  # type: ignore[method-assign]


def plain_name(name: str) -> str:
    """The parameter's name without the wrappers that activation checkpointing and compile insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its plain name; a weight tied across pipeline ranks under its first name only
    (as one process names it), its other copies left out."""
    return {
        plain_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
        if not is_tied_copy(p)
    }


def checkpoint_callback(config: dict, every: int) -> ModelCheckpoint:
    """A ``ModelCheckpoint`` saving every ``every`` optimizer steps into ``config["ckpt_dir"]`` as ``step=N.ckpt``,
    keeping ``config["keep"]`` of them (default: all; 2 or more keep the newest by step) and ``last.ckpt`` as
    ``config["save_last"]`` says (None, True, or "link")."""
    keep = config.get("keep", -1)
    newest = {"monitor": "step", "mode": "max"} if keep > 1 else {}
    return ModelCheckpoint(
        dirpath=config["ckpt_dir"],
        every_n_train_steps=every,
        save_top_k=keep,
        save_last=config.get("save_last"),
        filename="{step}",
        **newest,
    )


def main(config: dict) -> None:
    L.seed_everything(config["seed"], verbose=False)
    FUSED_LOSS_CALLS[0] = 0
    model_config = Qwen3Config.tiny(**config.get("model", {}))
    global_batch, accumulate = config["global_batch"], config.get("accumulate", 1)
    dims = config.get("dims", {})
    dp = config["dp"]
    train = train_corpus(config, model_config.vocab_size)
    val = val_corpus(config, model_config.vocab_size)  # padded with config["pad"], as training is
    recorder = RecordLosses()
    grad_norms = RecordGradNorms(pipelined=dims.get("pp", 1) > 1)
    callbacks: list[Callback] = [recorder, grad_norms]
    step_grads = RecordGrads(pipelined=dims.get("pp", 1) > 1)
    if config.get("record_grads"):
        callbacks.append(step_grads)
    recompute = RecordRecompute()
    if config.get("record_recompute"):
        callbacks.append(recompute)
    if config.get("moe_balance"):  # {"rate": bias update rate, "unchosen": experts no token may choose}
        callbacks += [
            ExcludeExperts(config["moe_balance"]["unchosen"]),
            ExpertLoadBalancing(config["moe_balance"]["rate"]),
        ]
    if config.get("kill_at_step"):  # with "dies": True
        callbacks.append(KillAt(config["kill_at_step"], config["out"]))
    if config.get("slow_write"):  # {"marker": "step=4", "seconds": 30}
        slow_down_writes_of(config["slow_write"]["marker"], config["slow_write"]["seconds"])
    preemption = None
    if config.get(
        "preempt"
    ):  # {"rank", "step", "at"}: a SIGUSR1 to one rank, stopped and saved by Preemption
        preemption = Preemption(config["ckpt_dir"])
        callbacks += [preemption, SignalAt(**config["preempt"])]
        if config.get("requeue_ends_the_job"):  # with "dies": True
            callbacks.append(RequeueEndsTheJob(preemption, config["out"]))
    folder = RecordFolder(config["ckpt_dir"]) if config.get("record_folder") else None
    if folder is not None:
        callbacks.append(folder)
    if config.get("save_every"):
        # an interval, or several (one ModelCheckpoint each): e.g. [4, 7] saves an epoch end and a mid-epoch step
        every = config["save_every"]
        callbacks += [checkpoint_callback(config, n) for n in (every if isinstance(every, list) else [every])]
    trainer = L.Trainer(
        strategy=D9DStrategy(**dims, lora=LoRA(**config["lora"]) if config.get("lora") else None),
        accelerator=config.get("accelerator", "cpu"),
        devices=config["devices"],
        num_nodes=config.get("num_nodes", 1),
        precision=config.get("precision", "32-true"),
        max_steps=config["max_steps"],
        accumulate_grad_batches=accumulate,
        gradient_clip_val=config.get("clip"),
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=bool(config.get("save_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    module = Qwen3Pretraining(
        model_config, lr=config["lr"], warmup_steps=2, max_steps=config["schedule_steps"]
    )
    if config.get("plain_module"):
        module.model = build_plain_model(model_config.vocab_size)  # type: ignore[assignment]
    if config.get("moe") is not None:  # Qwen3-MoE, router losses on; on meta, as configure_model builds
        with torch.device("meta"):
            moe = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(**config["moe"]))
        # the strategy scales the router losses like the loss (1 / accumulate_grad_batches): not set here
        module.model = moe  # type: ignore[assignment]
    if config.get("freeze"):  # a user's frozen modules: the parameters whose names hold one of these parts
        if module.model is None:
            with torch.device("meta"):  # as configure_model builds it
                module.model = Qwen3ForCausalLM(model_config)  # type: ignore[assignment]
        freeze(module, config["freeze"])
    if config.get("uncounted_loss"):
        module.loss_fn = uncounted_loss
    use_optimizer(module, config)
    per_rank = global_batch // dp
    trainer.fit(module, DataLoader(train, batch_size=per_rank), ckpt_path=config.get("resume_from"))
    params = full_parameters(module)
    if dist.is_initialized() and trainer.strategy.parallel_dims.pp_enabled:
        # each pipeline rank holds other layers: collect them all (global names, so they merge)
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, params)
        params = {name: tensor for part in gathered for name, tensor in part.items()}
    result: dict[str, Any] = {"losses": recorder.losses, "grad_norms": grad_norms.norms, "params": params}
    if config.get("record_grads"):
        result["step_grads"] = step_grads.grads
    result["preempted"] = str(preemption.saved) if preemption is not None and preemption.saved else None
    result["folder_at_batch_start"] = folder.seen if folder is not None else None
    result["global_step"] = trainer.global_step
    if config.get("validate"):
        metrics = trainer.validate(module, DataLoader(val, batch_size=per_rank), verbose=False)
        result["val_loss"] = metrics[0]["val/loss"]
    result["moe_load"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("moe/")}
    result["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    # which parameters train, and which hold optimizer state (LoRA: the adapters alone)
    result["trainable"] = sorted(plain_name(n) for n, p in module.named_parameters() if p.requires_grad)
    names = {id(p): plain_name(n) for n, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    result["optimizer_state"] = sorted(
        names.get(id(p), f"?{tuple(p.shape)}") for p in optimizer.state if optimizer.state[p]
    )
    result["dtensor_params"] = any(isinstance(p, DTensor) for p in module.parameters())
    result["backend"] = dist.get_backend() if dist.is_initialized() else None
    # who launched the ranks (Lightning's cluster environment), and every rank's node: as all-gathered
    result["environment"] = type(trainer.strategy.cluster_environment).__name__
    nodes: list[Any] = [trainer.node_rank]
    if dist.is_initialized():
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, trainer.node_rank)
    result["node_ranks"] = nodes
    # that compile and activation checkpointing were applied: blocks compiled in place, blocks wrapped
    result["compiled_modules"] = sum(
        getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )
    result["checkpointed_modules"] = sum(hasattr(m, "_checkpoint_wrapped_module") for m in module.modules())
    result["recomputed_ops"] = sorted(recompute.ops)  # rank 0's, with config["record_recompute"]
    calls = torch.tensor(FUSED_LOSS_CALLS[0], device=trainer.strategy.root_device)  # NCCL: on the GPU
    if dist.is_initialized():  # under pp only the ranks that hold the last stage compute the loss
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    result["fused_loss_calls"] = int(calls)
    if trainer.is_global_zero:
        torch.save(result, config["out"])
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def compile_backend(backend: str | None) -> Iterator[None]:
    """Blocks compiled by ``backend`` instead of Inductor while the run lasts (``None``: unchanged). With
    ``"aot_eager"`` dynamo traces the blocks and AOTAutograd splits forward and backward as under Inductor,
    without its code generation: tens of seconds per rank of a 2-core machine, which the parity of tracing
    with FSDP units inside the blocks does not need."""
    if backend is None:
        yield
        return
    inductor_compile = nn.Module.compile

    def compile_with_backend(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        inductor_compile(self, *args, **{**kwargs, "backend": backend, "mode": None})

    nn.Module.compile = compile_with_backend  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.compile = inductor_compile  # type: ignore[method-assign]


@contextlib.contextmanager
def timed(run: dict) -> Iterator[None]:
    """With ``$TRAINER_SCRIPT_TIMES`` naming a file, append ``<run> <devices> <seconds>`` to it when ``run``
    ends: where a launch's time goes, run by run."""
    started = time.monotonic()
    yield
    times = os.environ.get("TRAINER_SCRIPT_TIMES")
    if times and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(times, "a") as log:
            log.write(f"{Path(run['out']).stem} {run['devices']} {time.monotonic() - started:.1f}\n")


def run_all(configs: list[dict]) -> None:
    """The configs one after the other in this process (start-up is most of the cost of a small run; the
    process group is reused, every run builds its own mesh)."""
    for one in configs:
        try:
            with timed(one), compile_backend(one.get("compile_backend")):
                main(one)
        except BaseException as error:
            error.add_note(f"in the run that writes {one['out']}")  # which of a launch's runs failed
            raise
    # Shut the groups down before the interpreter does: left to interpreter exit, a gloo group's threads can
    # still be running when its destructor runs, and the process aborts ("terminate called without an active
    # exception", seen once in CI after a tp resume had finished and saved its result).
    if dist.is_initialized():
        dist.destroy_process_group()


# How the ranks of a run with "dies" end: SIGKILL, or the requeue's SIGTERM where no handler was installed (a rank
# that has left fit, Lightning's handlers restored, and waits for rank 0 in the script's last collectives).
STAGED_ENDS = (signal.SIGKILL, signal.SIGTERM)


def stretches(configs: list[dict]) -> list[list[dict]]:
    """The stretches of ``fork_ranks``: consecutive configs with the same ``devices``; a config with
    ``"new_ranks": True`` starts a stretch of its own (new processes, e.g. to resume from a checkpoint that the
    previous stretch's ranks wrote), and one with ``"dies": True`` is a stretch alone."""
    grouped: list[list[dict]] = []
    for config in configs:
        joins = grouped and grouped[-1][0]["devices"] == config["devices"] and not grouped[-1][-1].get("dies")
        if joins and not config.get("new_ranks") and not config.get("dies"):
            grouped[-1].append(config)
        else:
            grouped.append([config])
    return grouped


def fork_ranks(configs: list[dict], run: Callable[[list[dict]], None] | None = None) -> int:
    """``--fork``: run each stretch of :func:`stretches` (consecutive configs with the same ``devices``) on that
    many ranks forked from this process, one stretch after the other, and return the exit status (the first
    failed rank's, else 0). The ranks get torchrun's environment, so Lightning takes them for torchrun's (it
    starts no processes and the strategy runs as under torchrun); forked after the imports, they do not each pay
    for them again (torch + Lightning: about 7 s of CPU per process, most of a small run on 2 cores). As torchrun
    does, a failed rank's peers are killed: they would wait for it in a collective. Every stretch runs on new processes,
    so a run that resumes in a later stretch reads a checkpoint that other processes wrote. A stretch whose
    rank died by a signal of ``LIBC_CRASHES`` runs once more, with a warning on stderr. A run with ``"dies":
    True`` (a crash staged by ``KillAt`` or ``RequeueEndsTheJob``) must end with its ranks killed by a signal of
    ``STAGED_ENDS``, and the launch goes on. ``run``: what each rank runs on its stretch's configs (default: :func:`run_all`, the
    Trainer's runs)."""
    launcher = os.getpid()
    run = run_all if run is None else run
    for group in stretches(configs):
        devices = int(group[0]["devices"])
        codes = _fork_stretch(devices, group, launcher, run)
        crash = _crash(codes)
        if crash in LIBC_CRASHES:
            print(
                f"a rank died by {signal.Signals(crash).name}; running its stretch once more", file=sys.stderr
            )
            codes = _fork_stretch(devices, group, launcher, run)
        if group[0].get("dies"):
            if codes and all(-code in STAGED_ENDS for code in codes):
                continue
            print(f"a run that was to be killed ended with {codes}", file=sys.stderr)
            return _status(codes) or 1
        if _status(codes):
            return _status(codes)
    return 0


def _status(codes: list[int]) -> int:
    """A stretch's exit status: 0, the first failed rank's code, or 128 + a signal's number, as a shell says."""
    failed = [code for code in codes if code != 0]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 128 - failed[0]


def _crash(codes: list[int]) -> int | None:
    """The signal a rank of a stretch died by, if one did."""
    return next((-code for code in codes if code < 0), None)


def _fork_stretch(
    devices: int, configs: list[dict], launcher: int, run: Callable[[list[dict]], None]
) -> list[int]:
    """One stretch on ``devices`` forked ranks: the exit codes of the ranks that ended by themselves (a negative
    code is the signal that ended one), in the order they ended; the ranks still running once one failed and
    the grace passed are killed."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: set[int] = set()
    for rank in range(devices):
        pid = os.fork()
        if pid == 0:
            os._exit(_forked_rank(rank, devices, port, configs, launcher, run))
        ranks.add(pid)
    codes: list[int] = []
    while ranks and not any(codes):  # every rank, or until one fails
        pid, wait_status = os.wait()
        ranks.discard(pid)
        codes.append(os.waitstatus_to_exitcode(wait_status))
    grace = (
        time.monotonic() + 2.0
    )  # the peers get a moment: one that crashed first is then still seen crashing
    while ranks and time.monotonic() < grace:
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        ranks.discard(pid)
        codes.append(os.waitstatus_to_exitcode(wait_status))
    for other in ranks:  # they would wait forever in a collective with the failed rank
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)
    return codes


def _forked_rank(
    rank: int,
    world_size: int,
    port: int,
    configs: list[dict],
    launcher: int,
    run: Callable[[list[dict]], None],
) -> int:
    with contextlib.suppress(OSError, AttributeError):  # die with the launch (a test's timeout kills only it)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, Linux
    if os.getppid() != launcher:  # it died before prctl
        return 1
    set_torchrun_environment(rank, world_size, port, "trainer_script_fork")
    try:
        run(configs)
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    # ``'<config or list of configs>'`` in every process of a launch (torchrun's, Lightning's), or
    # ``--fork '<list of configs>'``: this process starts the ranks (``fork_ranks``).
    if sys.argv[1] == "--fork":
        sys.exit(fork_ranks(json.loads(sys.argv[2])))
    configs = json.loads(sys.argv[1])
    run_all(configs if isinstance(configs, list) else [configs])
