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

SwiGLU MLP: a module whose class name ends in ``MLP`` holding exactly ``gate_proj``, ``up_proj``, ``down_proj``
(``nn.Linear``) and a parameter-free ``act_fn``, whose class's forward is ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))`` with SiLU as ``act_fn`` (Llama's, Qwen2/3's, Mistral's, Qwen3-MoE's dense and shared MLPs), checked
on a random CPU input as above, gets ``down_proj(swiglu(gate_proj(x), up_proj(x)))``
(:func:`~lightning_d9d.kernels.swiglu.swiglu`: one Triton pass each way on CUDA in eager mode, which keeps no
``silu(gate)`` for backward; the reference elsewhere). The projections stay the modules they were, so the tp
plan's colwise / rowwise styles and FSDP apply to them as before; only the elementwise gate in between changes.

RoPE is not swapped: ``transformers`` applies it in a module-level function of each family's modeling file
(``apply_rotary_pos_emb``), not in a module whose forward we could replace.

``transformers`` >= 5.25 wraps some classes' forwards (the attention modules of Llama, Qwen3, ...: its
``use_kernelized_func``, from the ``kernels`` package) so that a module-level function they call (RoPE's) can be
routed to a Hub kernel; the wrapper sets a context variable around the original forward. Compiled inside an
activation-checkpointed layer, that write is a side effect torch refuses ("HOP: Unsafe side effect", the whole
layer then fails to compile). With nothing routed (no Hub kernel loaded: ``kernelize`` was not called) the
function the forward calls is the plain one either way, so :func:`unwrap_hub_kernel_forwards` gives such modules
their class's original forward when the strategy compiles.

``$LIGHTNING_D9D_HF_KERNELS=0`` leaves every module as it is (default ``1``), an MoE model's experts without ep
too (:mod:`lightning_d9d.models.hf.expert`). Independently,
``$LIGHTNING_D9D_KERNELS=reference`` keeps the swapped forward on the PyTorch reference.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_d9d.kernels.rmsnorm import rms_norm, rms_norm_reference
from lightning_d9d.kernels.swiglu import swiglu, swiglu_reference

ENV_VAR = "LIGHTNING_D9D_HF_KERNELS"
SWAPPED = "_d9d_kernel"  # the instance attribute naming the kernel a module's forward was swapped for
RMS_NORM_NAMES = re.compile(r".*RMSNorm")
MLP_NAMES = re.compile(r".*MLP")
MLP_CHILDREN = ["gate_proj", "up_proj", "down_proj", "act_fn"]
NOT_RMS_NORM_NAMES = re.compile(r"Gemma.*")  # weight offset by one: a different forward
log = logging.getLogger("lightning_d9d.models.hf")
_CHECKED: dict[tuple[type, float], bool] = {}
_CHECKED_MLPS: dict[tuple[type, type], bool] = {}


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


def _swiglu_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _matches_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a SwiGLU MLP we may swap: see the module docstring."""
    cls = type(module)
    if not MLP_NAMES.fullmatch(cls.__name__) or "forward" in vars(module) or list(module.buffers()):
        return False
    children = dict(module.named_children())
    if sorted(children) != sorted(MLP_CHILDREN) or any(True for _ in children["act_fn"].parameters()):
        return False
    if not all(isinstance(children[name], nn.Linear) for name in MLP_CHILDREN[:3]):
        return False
    key = (cls, type(children["act_fn"]))
    if key not in _CHECKED_MLPS:
        _CHECKED_MLPS[key] = _same_mlp_numbers(cls.forward, children["act_fn"])
        if not _CHECKED_MLPS[key]:
            log.info("%s: its forward is not a SiLU-gated MLP; not swapped", cls.__name__)
    return _CHECKED_MLPS[key]


def _same_mlp_numbers(forward: Callable[..., Any], act_fn: nn.Module) -> bool:
    # the probe's own weights, drawn without advancing the caller's RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gate, up, down = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
    probe = types.SimpleNamespace(gate_proj=gate, up_proj=up, down_proj=down, act_fn=copy.deepcopy(act_fn))
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for linear in (gate, up, down):
            linear.to(dtype)
        x = torch.randn(3, 5, 8, generator=generator).to(dtype)
        try:
            with torch.no_grad():
                theirs = forward(probe, x)
                ours = down(swiglu_reference(gate(x), up(x)))
        except Exception:  # a forward reading more than the four children: not ours to swap
            return False
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
            return False
        if not torch.equal(theirs, ours):
            return False
    return True


SWAPS: dict[str, tuple[Callable[[nn.Module], bool], Callable[..., torch.Tensor]]] = {
    "rms_norm": (_matches_rms_norm, _rms_norm_forward),
    "swiglu": (_matches_swiglu_mlp, _swiglu_mlp_forward),
}


def swap_hf_kernels(model: nn.Module) -> list[str]:
    """Give ``model``'s matching RMSNorms and SwiGLU MLPs our forwards, in place (see the module docstring),
    unless ``$LIGHTNING_D9D_HF_KERNELS=0``. Returns the swapped modules' names. Call it before any parallel
    plan."""
    if not hf_kernels_enabled():
        return []
    swapped: dict[str, list[str]] = {kernel: [] for kernel in SWAPS}
    for name, module in model.named_modules():
        if getattr(module, SWAPPED, None) is not None:
            continue
        for kernel, (matches, forward) in SWAPS.items():
            if matches(module):
                module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
                setattr(module, SWAPPED, kernel)
                swapped[kernel].append(name)
                break
    for kernel, names in swapped.items():
        if names:
            log.info(
                "%s: %d modules run lightning_d9d's %s (set $%s=0 to keep transformers' forwards)",
                type(model).__name__,
                len(names),
                kernel,
                ENV_VAR,
            )
    return [name for names in swapped.values() for name in names]


def unwrap_hub_kernel_forwards(model: nn.Module) -> list[str]:
    """Give modules whose class forward is ``kernels``' routing wrapper (``use_kernelized_func``) the forward it
    wraps, where no Hub kernel is routed (see the module docstring). Returns their names."""
    unwrapped = []
    for name, module in model.named_modules():
        forward = type(module).forward
        original = getattr(forward, "__wrapped__", None)
        routed = getattr(module, "_kernel_funcs", None)
        if original is None or not isinstance(routed, dict) or "forward" in vars(module):
            continue
        code = getattr(forward, "__code__", None)
        if code is None or code.co_name != "new_forward":  # functools.wraps copied the name: the code tells
            continue
        if any(
            "forward" in vars(func) for func in routed.values()
        ):  # a Hub kernel routed (kernelize): keep it
            continue
        module.forward = types.MethodType(original, module)  # type: ignore[method-assign]
        unwrapped.append(name)
    if unwrapped:
        log.info(
            "%s: %d modules run their class's forward without kernels' routing wrapper (it cannot compile "
            "inside activation checkpointing)",
            type(model).__name__,
            len(unwrapped),
        )
    return unwrapped
