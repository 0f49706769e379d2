"""Our kernels in place of a ``transformers`` model's modules, by module type, where shapes and semantics match.

RMSNorm: ``transformers``' RMSNorms (``Qwen3RMSNorm``, ``LlamaRMSNorm``, ``MistralRMSNorm``, ..., Qwen3's q/k
norms included) compute ``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype)``: statistics in fp32, the
normalised value cast back to the input dtype, *then* times the weight; exactly
:func:`~lightning_d9d.kernels.rmsnorm.rms_norm_reference`. Such a module gets a forward of ours
(:func:`~lightning_d9d.kernels.rmsnorm.rms_norm`: the Triton kernel on CUDA tensors in eager mode, the reference
on CPU, on DTensors and inside ``torch.compile``). Only the forward changes: the module, its class, its
``weight`` Parameter (names, ties, checkpoints) and ``variance_epsilon`` stay, so the tp plan's styles (the
per-head norm on q/k norms, sequence parallelism on the layer norms: both hand the forward DTensors, which the
reference runs on) apply to the swapped module as to the original.

A module is swapped when its class name ends in ``RMSNorm`` (Gemma's ``1 + weight`` norms excepted by name), it
holds a 1-D ``weight`` and a float ``variance_epsilon`` and nothing else, and its class's own forward gives our
reference's numbers on a random CPU input (fp32 and bf16 inputs, a random fp32 weight: the bf16 case tells the
cast order apart), checked once per class and eps at swap time.

``$LIGHTNING_D9D_HF_KERNELS=0`` leaves every module as it is (default ``1``). Independently,
``$LIGHTNING_D9D_KERNELS=reference`` keeps the swapped forward on the PyTorch reference.
"""

from __future__ import annotations

import logging
import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_d9d.kernels.rmsnorm import rms_norm, rms_norm_reference

ENV_VAR = "LIGHTNING_D9D_HF_KERNELS"
SWAPPED = "_d9d_kernel"  # the instance attribute naming the kernel a module's forward was swapped for
RMS_NORM_NAMES = re.compile(r".*RMSNorm")
NOT_RMS_NORM_NAMES = re.compile(r"Gemma.*")  # weight offset by one: a different forward
log = logging.getLogger("lightning_d9d.models.hf")
_CHECKED: dict[tuple[type, float], bool] = {}


def hf_kernels_enabled() -> bool:
    """``$LIGHTNING_D9D_HF_KERNELS``: ``1`` (the default) swaps, ``0`` leaves the modules alone."""
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in ("", "1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(
        f"${ENV_VAR}={value!r}: use 1 (swap in our kernels, the default) or 0 (leave the modules)"
    )


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # read at call time: the tp styles replace ``weight`` by a DTensor Parameter after the swap
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _matches_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm we may swap: see the module docstring."""
    cls = type(module)
    if not RMS_NORM_NAMES.fullmatch(cls.__name__) or NOT_RMS_NORM_NAMES.fullmatch(cls.__name__):
        return False
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.ndim != 1 or not weight.is_floating_point():
        return False
    if not isinstance(eps, float) or isinstance(eps, bool) or "forward" in vars(module):
        return False
    if [name for name, _ in module.named_parameters()] != ["weight"] or list(module.buffers()):
        return False
    key = (cls, eps)
    if key not in _CHECKED:
        _CHECKED[key] = _same_numbers(cls.forward, eps)
        if not _CHECKED[key]:
            log.info("%s: its forward differs from RMSNorm's reference; not swapped", cls.__name__)
    return _CHECKED[key]


def _same_numbers(forward: Callable[..., Any], eps: float) -> bool:
    generator = torch.Generator().manual_seed(0)
    dim = 24
    weight = torch.randn(dim, generator=generator) + 1
    probe = types.SimpleNamespace(weight=weight, variance_epsilon=eps)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 5, dim, generator=generator) * 3).to(dtype)
        try:
            with torch.no_grad():
                theirs = forward(probe, x)
        except Exception:  # a forward reading more than weight and variance_epsilon: not ours to swap
            return False
        ours = rms_norm_reference(x, weight, eps)
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
            return False
        if not torch.allclose(theirs, ours, rtol=1e-6, atol=1e-6):
            return False
    return True


def swap_hf_kernels(model: nn.Module) -> list[str]:
    """Give ``model``'s matching RMSNorms our forward, in place (see the module docstring), unless
    ``$LIGHTNING_D9D_HF_KERNELS=0``. Returns the swapped modules' names. Call it before any parallel plan."""
    if not hf_kernels_enabled():
        return []
    swapped = []
    for name, module in model.named_modules():
        if getattr(module, SWAPPED, None) is None and _matches_rms_norm(module):
            module.forward = types.MethodType(_rms_norm_forward, module)  # type: ignore[method-assign]
            setattr(module, SWAPPED, "rms_norm")
            swapped.append(name)
    if swapped:
        log.info(
            "%s: %d RMSNorm modules run lightning_d9d's rms_norm (set $%s=0 to keep transformers' forward)",
            type(model).__name__,
            len(swapped),
            ENV_VAR,
        )
    return swapped
