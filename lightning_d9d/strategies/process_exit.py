"""The default process group destroyed when the script returns, before the interpreter tears down."""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def destroy_process_group_at_exit() -> None:
    """Register, once per process, an exit handler that destroys the default process group if it is still up.

    Why: Lightning destroys the group only when a run fails; a script that trains, saves and returns leaves it to
    the interpreter's teardown, where gloo's worker threads may still hold finished work with tensors in it.
    Freeing those after Python is half torn down aborts the process (SIGABRT, "terminate called without an active
    exception") although every step succeeded: seen once on a 2-core CI machine at the end of
    ``examples/fabric_pretrain_qwen3.py``. ``atexit`` handlers run after Python's own threads are joined (a
    background checkpoint write has finished) and while the interpreter is whole."""
    global _registered
    if not _registered:
        atexit.register(_destroy_if_initialized)
        _registered = True


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
