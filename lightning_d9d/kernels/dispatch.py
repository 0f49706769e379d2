"""When the Triton kernels run instead of their PyTorch references, and how a kernel is launched on CPU tensors.

``$LIGHTNING_D9D_KERNELS``: ``auto`` (the default) runs Triton on CUDA tensors in eager mode and the references
everywhere else; ``reference`` always runs the references; ``triton`` runs Triton wherever it can, CPU tensors
included when ``TRITON_INTERPRET=1`` (how CI tests the kernels without a GPU).

The references run where Triton cannot or need not: DTensors (tensor / sequence parallel activations: the
reference's ops dispatch on them), and inside ``torch.compile`` (Inductor fuses the reference itself, and the
compiled blocks are traced with ``fullgraph=True``), except kernels registered as torch custom operators (the
MoE permutation), which compiled code calls as they are.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels.triton_compat import AVAILABLE

ENV_VAR = "LIGHTNING_D9D_KERNELS"
MODES = ("auto", "reference", "triton")
log = logging.getLogger("lightning_d9d.kernels")
_ANNOUNCED: set[str] = set()
_INTERPRETED: dict[int, Any] = {}


def triton_installed() -> bool:
    return AVAILABLE


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_mode() -> str:
    mode = os.environ.get(ENV_VAR) or "auto"
    if mode not in MODES:
        raise ValueError(f"${ENV_VAR}={mode!r}: choose one of {MODES}")
    return mode


def use_triton(name: str, *tensors: torch.Tensor, gpu_checked: bool = True, traceable: bool = False) -> bool:
    """Whether kernel ``name`` runs its Triton version on these tensors (see the module docstring); logs the
    choice once per kernel. ``gpu_checked=False``: a kernel whose GPU tests have not run yet, which ``auto``
    leaves on its reference (``triton`` still runs it). ``traceable``: the kernel is a torch custom operator,
    which ``torch.compile`` calls as it is, so it runs inside compiled code too."""
    mode = kernel_mode()
    compiling = torch.compiler.is_compiling()
    if mode == "reference" or (compiling and not traceable) or (mode == "auto" and not gpu_checked):
        return False
    if any(isinstance(t, DTensor) for t in tensors) or not triton_installed():
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    chosen = (
        on_cuda
        if mode == "auto"
        else on_cuda or (interpreting() and all(t.device.type == "cpu" for t in tensors))
    )
    if chosen and not compiling:  # a log call would break the traced graph; the operator announces itself
        announce(name)
    return chosen


def announce(name: str) -> None:
    """Log once that kernel ``name`` runs its Triton version."""
    if name not in _ANNOUNCED:
        _ANNOUNCED.add(name)
        log.info("%s: Triton kernel (set $%s=reference for the PyTorch reference)", name, ENV_VAR)


def launchable(kernel: Any, device: torch.device) -> Any:
    """``kernel`` as it can run on ``device``: itself on CUDA; on CPU, under ``TRITON_INTERPRET=1``, its
    interpreted twin (``triton.jit`` decides at import time, so a kernel imported before the variable was set
    would otherwise refuse CPU tensors)."""
    if device.type == "cuda":
        return kernel
    if not interpreting():
        raise RuntimeError(
            f"Triton kernels take CUDA tensors, got {device}; set TRITON_INTERPRET=1 to run them on CPU"
        )
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    twin = _INTERPRETED.get(id(kernel))
    if twin is None:
        twin = _INTERPRETED[id(kernel)] = InterpretedFunction(kernel.fn)
    return twin
