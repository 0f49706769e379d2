import os
import sys
import warnings
from collections.abc import Iterator

import pytest
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


@pytest.fixture(autouse=True)
def no_process_group_left_behind() -> Iterator[None]:
    """The distributed tests fork their gloo ranks from this process (tests/distributed.py) and launch others
    as subprocesses. An in-process run (a one-device Trainer, the docs' snippets) leaves a default process group
    here, which every later forked rank would inherit ("trying to initialize the default process group twice"),
    and Lightning's MASTER_PORT / RANK / WORLD_SIZE in the environment, which later launches would inherit
    ("address already in use"): destroy the group and restore the environment after each test. A group that
    existed before the test (a module-scoped fixture's, as in the GPU tests) is its owner's to destroy."""
    environment = dict(os.environ)
    group_before = dist.is_available() and dist.is_initialized()
    yield
    if not group_before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
