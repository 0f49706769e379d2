import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Under pytest-xdist (``make test``: a worker per core) each worker's own ops get its share of the cores: two
# workers with a pool as wide as the machine each oversubscribed two cores (the suite: 1,756 CPU-s against 1,538
# with this). Set before torch starts its pool; launched scripts inherit it (forked ranks take one thread anyway).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(
        max(
            1,
            (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
            // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]),
        )
    )

import torch

# Without a GPU the Triton kernels' tests run in Triton's CPU interpreter, which triton.jit picks when triton is
# imported (torch._dynamo imports it, below).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported before any fork so that ranks do not each pay for these lazy imports.
import torch._dynamo
import torch.distributed as dist
import torch.distributed.tensor

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*does not support alltoall.*")


@contextlib.contextmanager
def _nothing_left_behind() -> Iterator[None]:
    """Destroy a default process group created inside, and put the environment back as it was."""
    environment = dict(os.environ)
    group_before = dist.is_available() and dist.is_initialized()
    yield
    if not group_before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(autouse=True, scope="module")
def no_environment_left_behind_by_a_module() -> Iterator[None]:
    """The same for a test module: a module-scoped fixture that fits in this process (a one-device Trainer) sets
    Lightning's LOCAL_RANK / MASTER_PORT before the per-test guard below takes its snapshot, so that guard keeps
    them. A later module's Trainer would then take its processes as launched by someone else and wait for peers
    that never start: restore the environment, and destroy a group left behind, when the module ends."""
    with _nothing_left_behind():
        yield


@pytest.fixture(autouse=True)
def no_process_group_left_behind() -> Iterator[None]:
    """The distributed tests fork their gloo ranks from this process (tests/distributed.py) and launch others
    as subprocesses. An in-process run (a one-device Trainer, the docs' snippets) leaves a default process group
    here, which every later forked rank would inherit ("trying to initialize the default process group twice"),
    and Lightning's MASTER_PORT / RANK / WORLD_SIZE in the environment, which later launches would inherit
    ("address already in use"): destroy the group and restore the environment after each test. A group that
    existed before the test (a module-scoped fixture's, as in the GPU tests) is its owner's to destroy."""
    with _nothing_left_behind():
        yield


def _shared_launch_scopes() -> dict[str, str]:
    """Test files whose tests share one session fixture's launch (tests/models/hf/conftest.py runs the parity
    runs of all of them at once), by the one pytest-xdist scope they share."""
    path = Path(__file__).parent / "models" / "hf" / "parity_modules.py"
    spec = importlib.util.spec_from_file_location("hf_parity_modules", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {f"tests/models/hf/{name}.py": "hf_parity_launch" for name in module.PARITY_MODULES}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test``'s ``--dist loadfile``: a test file runs in one worker (a module fixture's one launch serves
    all its cases), and so do the files that share a session fixture's launch. (Not ``--dist loadgroup`` with
    marks: pytest 9.2's structured node ids drop the group suffix xdist 3.8 writes, pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    shared = _shared_launch_scopes()

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return shared.get(scope, scope)

    return SharedLaunchScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
