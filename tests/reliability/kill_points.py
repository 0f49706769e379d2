"""Two gloo ranks training a tiny FSDP model with checkpoints, one of them SIGKILLed at a chosen point.

``launch(fn, *args)`` forks two ranks running ``fn(*args)`` and waits until both are gone. When one rank dies,
the other is killed at once, as torchrun's agent does (else it would wait in its next collective).

``KILL_POINTS`` name the places of a save (``lightning_d9d.state.training.save``) where a rank dies, each as
(rank killed, what to wrap). Wrapping happens in the forked rank only, so nothing leaks into the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict
import torch.distributed.device_mesh
import torch.distributed.fsdp
from distributed import free_port, freeze_inherited_heap
from torch import nn

from lightning_d9d.state import training  # imported before the forks: each rank would import it again

STEPS = 6  # train to step 6; checkpoints after steps 2, 4 and 6 (a resumed run's save after the kill)
SAVE_AT = (2, 4, 6)
KILLED_SAVE = 4  # the saves of step 4 are where ranks die
WORLD = 2


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------- the kill points
def _wrap(owner: Any, name: str, before: bool, when: Callable[..., bool] = lambda *a, **k: True) -> None:
    """Replace ``owner.name`` by a wrapper that dies before (or right after) the real call when ``when``."""
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if ARMED and before and when(*args, **kwargs):
            die()
        result = real(*args, **kwargs)
        if ARMED and not before and when(*args, **kwargs):
            die()
        return result

    setattr(owner, name, wrapper)


ARMED = False  # set while the save of step KILLED_SAVE runs, in the rank that is to die


def _install(point: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import lightning_d9d.state.atomic as atomic
    import lightning_d9d.state.manifest as manifest

    def names(suffix: str) -> Callable[..., bool]:
        return lambda *args, **kwargs: str(args[-1]).endswith(suffix) or str(args[0]).endswith(suffix)

    if point == "before_the_save":
        _wrap(atomic.AtomicDirectory, "open", before=True)
    elif point == "temporary_directory_made":
        _wrap(atomic.AtomicDirectory, "gather", before=True)
    elif point == "writing_its_shard":
        _wrap(FileSystemWriter, "write_data", before=True)
    elif point == "between_shard_writes":
        _wrap(FileSystemWriter, "write_data", before=False)
    elif point == "after_shard_writes":
        _wrap(training.dcp, "save", before=False)
        assert training.dcp is dcp
    elif point == "before_meta":
        _wrap(torch, "save", before=True, when=names(training.META_NAME))
    elif point == "before_the_manifest":
        _wrap(manifest, "write_manifest", before=True)
    elif point == "after_the_manifest":
        _wrap(manifest, "write_manifest", before=False)
    elif point == "between_the_renames":  # replacing "last": the old one is aside, the new one not yet in
        # (the second rename: its destination is "last"; the first one's is ".last.old-XXXXXXXX")
        _wrap(atomic.os, "rename", before=True, when=lambda src, dst: Path(dst).name == "last")
    elif point == "after_the_rename":  # the directory is in place; the other rank has not heard yet
        _wrap(
            atomic.os, "rename", before=False, when=lambda src, dst: Path(dst).name == f"step={KILLED_SAVE}"
        )
    elif point == "mid_step":  # not in a save: between backward and the optimizer step of step 5
        pass
    else:
        raise ValueError(point)


# (rank that dies, the step a fresh run must resume from): the step-4 save survives once it is renamed in
KILL_POINTS = {
    "before_the_save": (1, 2),
    "temporary_directory_made": (0, 2),
    "writing_its_shard": (1, 2),
    "between_shard_writes": (0, 2),
    "after_shard_writes": (1, 2),
    "before_meta": (0, 2),
    "before_the_manifest": (0, 2),
    "after_the_manifest": (0, 2),
    "between_the_renames": (0, KILLED_SAVE),
    "after_the_rename": (0, KILLED_SAVE),
    "mid_step": (1, KILLED_SAVE),
}


# ------------------------------------------------------------------------------------------ the training
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch for this rank: a function of the step, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (module[0], module[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2)


def train(root: str, point: str | None, resume: bool) -> dict[str, Any]:
    """Train to ``STEPS`` saving after ``SAVE_AT`` steps into ``root`` (``step=N`` then ``last``), resuming
    from the folder ``root`` when ``resume``; with ``point``, this rank may die there (see ``KILL_POINTS``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    global ARMED
    victim = point is not None and KILL_POINTS[point][0] == dist.get_rank()
    if victim:
        _install(point)  # type: ignore[arg-type]
    module, optimizer = build()
    start, resumed_from = 0, None
    if resume:
        meta = training.load(root, module, {0: optimizer}, strict=True, weights_only=True)
        start, resumed_from = int(meta["global_step"]), str(meta["name"])
    losses: dict[int, float] = {}
    for step in range(start + 1, STEPS + 1):
        inputs, target = batch(step)
        loss = (module(inputs) - target).square().mean()
        loss.backward()
        if victim and point == "mid_step" and step == KILLED_SAVE + 1:
            die()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total) / WORLD
        if step in SAVE_AT:
            ARMED = victim and step == KILLED_SAVE
            for name in (f"step={step}", "last"):
                checkpoint = {
                    "state_dict": get_model_state_dict(module),
                    "optimizer_states": [training.optimizer_state(module, optimizer)],
                    "global_step": step,
                    "name": name,
                }
                training.save(Path(root) / name, checkpoint)
            ARMED = False
    params = {name: p.full_tensor().clone() for name, p in module.named_parameters()}  # type: ignore[attr-defined]
    return {"losses": losses, "params": params, "resumed_from": resumed_from}


def save_with_rank_1_dying_before_commit(root: str) -> str:
    """Rank 1 dies between writing its part and the exchange that finishes the save: what rank 0 raises."""
    from lightning_d9d.state.atomic import AtomicDirectory

    if dist.get_rank() == 1:
        AtomicDirectory.commit = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    module, optimizer = build()
    checkpoint = {
        "state_dict": module.state_dict(),
        "optimizer_states": [training.optimizer_state(module, optimizer)],
    }
    try:
        training.save(Path(root) / "ckpt", checkpoint)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "saved"


def resume_each(roots: list[str]) -> dict[str, dict[str, Any]]:
    """``train(root, None, resume=True)`` for each folder, in one launch (start-up is most of a small run)."""
    results: dict[str, dict[str, Any]] = {}
    for root in roots:
        try:
            results[root] = train(root, None, resume=True)
        except Exception as error:  # reported per folder: one bad resume must not hide the others
            results[root] = {"error": f"{type(error).__name__}: {error}"}
    return results


# -------------------------------------------------------------------------------------------- launching
def _rank(rank: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    code = 1
    freeze_inherited_heap()
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        # a short timeout: a rank whose peer died must not wait the default 30 minutes
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
        result = fn(*args)
        torch.save(result, f"{out}.{rank}")
        code = 0
    except BaseException as error:
        Path(f"{out}.{rank}.error").write_text(f"{type(error).__name__}: {error}")
    finally:
        os._exit(code)


def launch(
    out: Path, fn: Callable[..., Any], *args: Any, deadline: float = 60, stop_others: bool = True
) -> list[Any]:
    """Run ``fn(*args)`` on two forked gloo ranks; each rank's result, or None for a rank that did not finish.
    ``stop_others=False`` lets the survivors of a dead rank run on (to see what they raise)."""
    context = mp.get_context("fork")
    port = free_port()
    processes = [
        context.Process(target=_rank, args=(rank, port, str(out), fn, args), daemon=True)
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline
    # As torchrun does when a worker dies: the others are stopped at once (they would wait in a collective).
    while any(p.is_alive() for p in processes) and time.monotonic() < end:
        if stop_others and any(p.exitcode not in (None, 0) for p in processes):
            break
        time.sleep(0.02)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    return [
        torch.load(f"{out}.{rank}", weights_only=False) if Path(f"{out}.{rank}").is_file() else None
        for rank in range(WORLD)
    ]
