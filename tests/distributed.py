"""Run a function on N gloo ranks forked from the test process (or N NCCL ranks, one GPU each, spawned; or N gloo
ranks sharing one GPU, spawned), and collect what each rank returns.

Forking is 10-30x cheaper than spawning (no second ``import torch``). Each rank leaves with ``os._exit`` after
``destroy_process_group`` because gloo sometimes aborts at interpreter exit after all work succeeded.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import random
import re
import signal
import socket
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Under pytest-xdist each worker takes its rendezvous ports from its own slice of these, below Linux's ephemeral
# range (32768-60999): a port the OS hands out for bind(0) or an outgoing connection can be handed to another
# worker's launch between our check and its TCPStore's bind (seen: EADDRINUSE in a concurrent launch).
_WORKER_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port that no socket holds now, for a launch's rendezvous: from this pytest-xdist worker's own slice of
    :data:`_WORKER_PORTS` (so two workers never pick the same one), else one the OS picks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(_WORKER_PORTS) // count
    low = _WORKER_PORTS.start + int(worker.removeprefix("gw")) * size
    # a random start: a fresh process (a launched script) does not walk the ports its parent just used
    start = random.randrange(size)
    for offset in range(size):
        port = low + (start + offset) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:  # (without SO_REUSEADDR: a port still in TIME_WAIT is refused too, as a TCPStore might be)
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + size - 1} for pytest-xdist worker {worker}")


def set_torchrun_environment(rank: int, world_size: int, port: int, run_id: str) -> None:
    """The variables torchrun gives a rank on one host, for a process forked by a test's own launcher:
    Lightning then takes the process for torchrun's (it starts no processes of its own)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_RUN_ID=run_id,
    )


# A GPU host's NVLink multicast (NVLS in NCCL, multicast objects in torch's symmetric memory) must stay off there:
# every NCCL rank of these tests runs with both switched off.
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def freeze_inherited_heap() -> None:
    """Call first in a process forked from the pytest process. It inherits that process's heap (every module
    earlier tests imported, Lightning's and transformers' among them); Python's collector would walk all of it in
    each full collection, and touching its pages copies them: a compile-heavy rank ran twice as slow after an
    in-process Trainer fit earlier in the same pytest process (44 against 23 s,
    tests/plans/test_fp8_compositions.py). Frozen, the inherited objects are left out of every collection; only
    what the child itself allocates is collected."""
    gc.freeze()


# Set in a rank of ``run_distributed(..., share_cuda=True)``: its device is the one GPU all ranks share.
SHARED_CUDA_ENV = "LIGHTNING_D9D_TEST_SHARED_CUDA"


def rank_device() -> torch.device:
    """The device a rank of :func:`run_distributed` computes on: its GPU under NCCL, the shared GPU under
    ``share_cuda=True``, else the CPU."""
    if dist.get_backend() == "nccl" or os.environ.get(SHARED_CUDA_ENV) == "1":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _share_cuda(world_size: int) -> None:
    """This rank on ``cuda:0`` beside the others, with a bounded part of the GPU's memory: each rank holds a CUDA
    context and its own caching allocator, and one rank must not take what its peers need."""
    os.environ[SHARED_CUDA_ENV] = "1"
    torch.cuda.set_device(0)
    torch.cuda.set_per_process_memory_fraction(0.9 / world_size, 0)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    group_timeout: timedelta | None = None,
    backend: str = "gloo",
    share_cuda: bool = False,
) -> None:
    code = 0
    freeze_inherited_heap()
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
        torch.set_num_threads(1)
        if share_cuda:
            _share_cuda(world_size)
        if backend == "nccl":
            os.environ.update(NCCL_ENVIRONMENT)
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl", rank=rank, world_size=world_size, timeout=group_timeout, device_id=device
            )
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=group_timeout)
        result = fn(*args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # put() hands the data to a feeder thread; wait for it, because os._exit would kill it mid-write.
        queue.close()
        queue.join_thread()
        os._exit(code)


class RankCrashed(RuntimeError):
    """A forked rank died (a signal) before it reported anything."""

    def __init__(self, rank: int, exitcode: int) -> None:
        super().__init__(f"rank {rank} died with exit code {exitcode} before reporting a result")
        self.exitcode = exitcode


# A forked rank killed by one of these (glibc's heap checks abort, a crash inside libc) is forked anew once by
# every launcher of the tests: forked ranks have now and then died so on the 2-core CI box, at random points
# ("malloc(): unaligned tcache chunk detected", pthread_join), in runs that pass when repeated.
LIBC_CRASHES = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300,
    group_timeout: timedelta | None = None,
    backend: str = "gloo",
    share_cuda: bool = False,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks (process group initialised, with the collective timeout
    ``group_timeout`` if given) and return results by rank.

    ``share_cuda=True``: every rank on ``cuda:0`` over gloo (NCCL refuses two ranks on one device), spawned as
    under NCCL, each allowed ``0.9 / world_size`` of the GPU's memory; :func:`rank_device` names the GPU there.
    Several ranks' CUDA code (DTensor, FSDP2's streams, the kernels on shards) then runs on one GPU, exactly but
    not fast: for proof, not speed.

    ``backend="nccl"``: rank ``r`` on GPU ``r`` (its current device, the group bound to it), NVLink multicast off
    (:data:`NCCL_ENVIRONMENT`), the ranks spawned, never forked (a fork of a process that has initialised CUDA,
    as pytest's has by the time the GPU tests run, cannot use CUDA): ``fn`` and ``args`` must pickle, and the
    ranks import what ``fn`` needs themselves.

    A rank that dies before reporting fails the call at once (not after ``timeout``), naming its exit code; when
    it takes its peers down with it (the store's host gone, they fail to connect), the crash is what is reported.
    One killed by SIGSEGV, SIGABRT or SIGBUS is forked anew once: ranks forked from a pytest process that ran
    Lightning fits itself have now and then crashed in libc (``pthread_join``, ``malloc(): unaligned tcache
    chunk``) before or while building their first groups (seen on the 2-core CI box; the test process's state,
    not the code under test), so that crash alone is retried, with a warning. The retry starts the ranks fresh
    (``spawn``: they import what ``fn`` needs themselves, seconds more) where ``fn`` and ``args`` can be pickled:
    a fork of the same process crashed twice in a row once (CI, a fork after threads Lightning's in-process fits
    left behind), a fresh process does not inherit that state."""
    if share_cuda and backend != "gloo":
        raise ValueError(f"share_cuda=True runs the ranks over gloo, not {backend!r}")
    first = "spawn" if backend == "nccl" or share_cuda else "fork"
    launch = functools.partial(_run_distributed_once, share_cuda=share_cuda)
    try:
        return launch(fn, world_size, args, timeout, group_timeout, first, backend)
    except RankCrashed as crash:
        if -crash.exitcode not in LIBC_CRASHES:
            raise
        method = "spawn" if _picklable(fn, args) else first
        warnings.warn(f"{crash}; starting the ranks again once ({method})", stacklevel=2)
        return launch(fn, world_size, args, timeout, group_timeout, method, backend)


def run_launched(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` for a command that starts ranks itself
    (``torch.distributed.run``, Lightning's launcher), run again once, with a warning, when a rank died by SIGSEGV,
    SIGABRT or SIGBUS: the crash :data:`LIBC_CRASHES` describes also hits these fresh processes on the 2-core CI
    box now and then (gloo's threads: "terminate called without an active exception" while the runs pass when
    repeated). Any other failure is returned as it is."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    signals = [int(code) for code in re.findall(r"exitcode\s*:\s*(-\d+)", done.stderr)]
    if done.returncode != 0 and any(-code in LIBC_CRASHES for code in signals):
        warnings.warn(
            f"a rank of {command[-1]!r} died by signal {signals}; launching it again once", stacklevel=2
        )
        done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return done


def _picklable(*objects: Any) -> bool:
    try:
        pickle.dumps(objects)
    except Exception:
        return False
    return True


def _run_distributed_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout: float,
    group_timeout: timedelta | None,
    method: str = "fork",
    backend: str = "gloo",
    share_cuda: bool = False,
) -> list[Any]:
    context = mp.get_context(method)
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, args, queue, group_timeout, backend, share_cuda),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                reported = set(results)
                for rank, process in enumerate(processes):
                    if rank not in reported and process.exitcode is not None and process.exitcode < 0:
                        raise RankCrashed(rank, process.exitcode) from None
                if time.monotonic() > deadline:
                    raise
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = (
                    payload  # the other ranks are probably stuck in a collective with the failed one
                )
    finally:
        # After an error, give the other ranks a moment to report or die: a peer's crash explains the error. A
        # rank that lost its peer's connection waits longer for that peer: one killed by SIGABRT can take
        # seconds to exit while its core is written (seen on the CI box: the peer still alive after 2 s, the
        # lost connection then reported instead of the crash, and the crash not retried).
        settle = time.monotonic() + (5 if not errors else 30 if _lost_a_peer(errors) else 2)
        for process in processes:
            process.join(timeout=max(0.0, settle - time.monotonic()))
        exitcodes = [process.exitcode for process in processes]  # before we kill any: ours would read -9
        for process in processes:
            if process.is_alive():
                process.kill()
    if errors:
        for rank, code in enumerate(exitcodes):
            if rank not in results and rank not in errors and code is not None and code < 0:
                raise RankCrashed(rank, code)
        rank, text = min(errors.items())
        raise RuntimeError(f"rank {rank} failed:\n{text}")
    return [results[rank] for rank in range(world_size)]


# What a rank's traceback says when the process it was talking to went away (the store's host, a gloo pair).
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "DistNetworkError")


def _lost_a_peer(errors: dict[int, str]) -> bool:
    return any(marker in text for text in errors.values() for marker in _LOST_PEER)


def summed_gradient_differences(model: Any, reference: Any) -> dict[str, float]:
    """Per parameter, how far ``model``'s gradients summed over the ranks are from ``reference``'s (one process
    on the whole batch), relative to the largest reference entry: for a loss each rank computes on its own part
    of the tokens, whose gradients add up to the whole batch's (context parallelism)."""
    differences = {}
    for (name, param), whole in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and whole.grad is not None, name
        grad = param.grad.clone()
        dist.all_reduce(grad)
        differences[name] = ((grad - whole.grad).abs().max() / whole.grad.abs().max()).item()
    return differences
