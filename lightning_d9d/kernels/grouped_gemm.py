"""Grouped GEMM: one matmul per expert over tokens already grouped by expert, behind one interface.

``grouped_mm(x, w, group_sizes)`` computes, for rows of ``x`` cut into consecutive groups of ``group_sizes``
rows, ``x[group g] @ w[g]``: ``x`` is ``[T, K]``, ``w`` is ``[G, K, N]``, ``group_sizes`` is ``[G]`` integers
summing to ``T`` (zeros allowed: an expert that received no token), the result is ``[T, N]``. Every backend
is differentiable in ``x`` and ``w``.

Backends, in the order ``auto`` tries them (the first that suits the inputs wins):

- ``torch``: ``torch.nn.functional.grouped_mm`` (public since torch 2.10; CUTLASS kernels for bf16 on Hopper
  and Blackwell). ``auto`` picks it only on CUDA, bf16, compute capability 9.x / 10.x, with row strides of 16
  bytes multiples: elsewhere torch falls back to a host loop that copies the offsets to the CPU. Named
  explicitly it also runs on CPU (fp32 / bf16), which is how CI checks it.
- ``grouped_gemm``: the ``grouped_gemm`` package (CUTLASS, bf16, CUDA) when installed. It is optional: a
  missing package makes the backend unavailable, never an import error.
- ``loop``: one ``torch.matmul`` per group, the reference; it runs everywhere (any dtype, any device) and
  synchronises with the host to read ``group_sizes``.

- ``torchao_fp8``: float8 (e4m3, rowwise scales) through torchao's MoE training kernels, on CUDA with
  compute capability 9.0 or newer (:mod:`lightning_d9d.kernels.grouped_gemm_fp8`). By name only: ``auto``
  never changes the precision; the FP8 plan (``D9DStrategy(fp8=...)``) names it for the experts it converts.

A Triton kernel can register itself later with :func:`register_grouped_gemm_backend`.

Choose with ``backend=`` or the environment variable ``LIGHTNING_D9D_GROUPED_GEMM`` (a backend name, or
``auto``); a named backend that cannot run the inputs is an error that says why. The first time each backend is
chosen, one INFO line on the ``lightning_d9d.kernels`` logger names it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_d9d.kernels.grouped_gemm_fp8 import (
    FLOAT8_BACKEND,
    fp8_grouped_gemm_unsupported,
    torchao_fp8_grouped_mm,
)
from lightning_d9d.kernels.grouped_gemm_triton import triton_grouped_mm, triton_unsupported
from lightning_d9d.kernels.registry import BackendRegistry

log = logging.getLogger("lightning_d9d.kernels")

ENV_VAR = "LIGHTNING_D9D_GROUPED_GEMM"

# (x [T, K], w [G, K, N], group_sizes [G]) -> [T, N]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x, w) -> None if the backend can run these inputs, else the reason it cannot.
Support = Callable[[torch.Tensor, torch.Tensor], "str | None"]


@dataclass(frozen=True)
class GroupedGemmBackend:
    """One implementation of :func:`grouped_mm`.

    ``unsupported(x, w)`` says why the backend cannot run these inputs (``None``: it can); ``preferred(x, w)``
    says whether ``auto`` should pick it for them (a backend may run somewhere without being fast there)."""

    name: str
    run: GroupedMatmul
    unsupported: Support
    preferred: Callable[[torch.Tensor, torch.Tensor], bool]


def check_grouped_inputs(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> None:
    """Shape checks that need no host synchronisation (the sum of ``group_sizes`` is checked by the loop)."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"grouped_mm takes x [T, K] and w [G, K, N], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x's last dimension ({x.shape[1]}) must equal w's dimension 1 ({w.shape[1]})")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group_sizes must hold one count per group: shape ({w.shape[0]},), got {tuple(group_sizes.shape)}"
        )
    if group_sizes.dtype.is_floating_point:
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")


# ----------------------------------------------------------------------------------------- loop
# The loop reads the group sizes on the host, which a CUDA graph cannot record (and a replay would not redo).
# torch's cudagraph_unsafe tag keeps these ops out of Inductor's CUDA graphs: with graph partitions (on by
# default; TORCHINDUCTOR_GRAPH_PARTITION) the graph is cut around them and its parts recorded; without, the
# whole graph runs without CUDA graphs (get_first_incompatible_cudagraph_node, counted in
# counters["inductor"]["cudagraph_skips"]).
_HOST_READ_TAGS = (torch.Tag.cudagraph_unsafe,)


def loop_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The reference: one matmul per group. Empty groups give empty blocks (and zero gradients for their ``w``).

    Inside ``torch.compile`` it runs as one custom operator (:func:`_traced_loop`): the group sizes are read on
    the host, which a traced graph cannot do (a compiled MoE block on CPU would fail to compile)."""
    if torch.compiler.is_compiling():
        return _traced_loop(x, w, group_sizes)
    sizes = [int(size) for size in group_sizes.tolist()]
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"group_sizes sum to {sum(sizes)} but x has {x.shape[0]} rows: they must be equal")
    blocks = x.split(sizes)
    return torch.cat([block @ w[group] for group, block in enumerate(blocks)])


def _loop_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    return None


@torch.library.custom_op("lightning_d9d::loop_grouped_mm", mutates_args=(), tags=_HOST_READ_TAGS)
def _traced_loop(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return loop_grouped_mm(x, w, group_sizes)


@_traced_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("lightning_d9d::loop_grouped_mm_backward", mutates_args=(), tags=_HOST_READ_TAGS)
def _traced_loop_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``d x = grad @ w[g].T`` per group; ``d w[g] = x_g.T @ grad_g`` (zero for an empty group)."""
    sizes = [int(size) for size in group_sizes.tolist()]
    grad_x = loop_grouped_mm(grad, w.transpose(1, 2), group_sizes)
    grad_w = torch.stack(
        [block.t() @ grad_block for block, grad_block in zip(x.split(sizes), grad.split(sizes), strict=True)]
    )
    return grad_x, grad_w.to(w.dtype)


@_traced_loop_backward.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # fresh contiguous tensors, as the real kernel returns them: empty_like would promise the inputs' strides (a
    # transposed weight view: transformers' experts), which Inductor then asserts against the real outputs
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _traced_loop_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _traced_loop_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w, group_sizes = ctx.saved_tensors
    grad_x, grad_w = _traced_loop_backward(grad.contiguous(), x, w, group_sizes)
    return grad_x, grad_w, None


_traced_loop.register_autograd(_traced_loop_grad, setup_context=_traced_loop_context)


# ---------------------------------------------------------------------------------------- torch
def _torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """``torch.nn.functional.grouped_mm``; absent before torch 2.10 (then this backend is unavailable)."""
    return getattr(F, "grouped_mm", None)


def _offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """Group end offsets as int32 on the device (what torch's kernel reads; no host synchronisation)."""
    return torch.cumsum(group_sizes, dim=0, dtype=torch.int32)


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    function = _torch_grouped_mm()
    if function is None:
        raise RuntimeError(_torch_unsupported(x, w))
    return function(x, w, offs=_offsets(group_sizes))


def _torch_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if _torch_grouped_mm() is None:
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (added in torch 2.10)"
    if x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != x.dtype:
        return f"torch's grouped_mm takes bf16 or fp32 operands of one dtype, got {x.dtype} and {w.dtype}"
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (w.shape[2] * size) % 16:
        return (
            f"torch's grouped_mm needs rows of a multiple of 16 bytes: K ({x.shape[1]}) and N ({w.shape[2]}) "
            f"times {size} bytes; pad the expert sizes to a multiple of {16 // size}"
        )
    return None


def _torch_preferred(x: torch.Tensor, w: torch.Tensor) -> bool:
    # Only where torch has a grouped kernel; elsewhere it loops on the host like our reference.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
        and _torch_unsupported(x, w) is None
    )


# --------------------------------------------------------------------------------- grouped_gemm
def _grouped_gemm_installed() -> bool:
    return importlib.util.find_spec("grouped_gemm") is not None


# Looked up once at import: Dynamo (torch 2.11) refuses to trace importlib's find_spec, and ``auto`` asks this
# backend whether it suits the inputs inside every compiled MoE block whose operands torch's kernel does not take
# (fp32, or a GPU without one): such a block failed to compile ("Attempted to call function marked as skipped").
_GROUPED_GEMM_INSTALLED = _grouped_gemm_installed()


def package_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The ``grouped_gemm`` package's ``ops.gmm``. It reads the group sizes as CPU int64 (a host
    synchronisation: its cuBLAS build needs them there; its CUTLASS build would also take them on the device)
    and takes contiguous operands only: a ``w`` that is the transposed view of a contiguous ``[G, N, K]``
    (transformers' expert layout, ``models/hf/expert.py``) goes as that tensor with ``trans_b``, no copy."""
    ops = importlib.import_module("grouped_gemm.ops")
    batch_sizes = group_sizes.to(device="cpu", dtype=torch.int64)
    x = x.contiguous()
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():
        transposed: torch.Tensor = ops.gmm(x, w.transpose(1, 2), batch_sizes, trans_b=True)
        return transposed
    result: torch.Tensor = ops.gmm(x, w.contiguous(), batch_sizes, trans_b=False)
    return result


def _package_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if not _GROUPED_GEMM_INSTALLED:
        return "the grouped_gemm package is not installed (pip install 'lightning-d9d[grouped-gemm]')"
    if not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"grouped_gemm runs bf16 on CUDA only, got {x.dtype} / {w.dtype} on {x.device}"
    if x.shape[1] % 8 or w.shape[2] % 8:
        # its CUTLASS kernel loads 16 bytes at a time and does not check the problem sizes against that
        return (
            f"grouped_gemm needs K ({x.shape[1]}) and N ({w.shape[2]}) to be multiples of 8 (16-byte rows of "
            "bf16); pad the expert sizes"
        )
    return None


def _package_preferred(x: torch.Tensor, w: torch.Tensor) -> bool:
    return _package_unsupported(x, w) is None


# ------------------------------------------------------------------------------------- registry
_REGISTRY: BackendRegistry[GroupedGemmBackend] = BackendRegistry(
    "grouped GEMM", ENV_VAR, fallback="loop", hint="the backend= argument", log=log
)


def register_grouped_gemm_backend(backend: GroupedGemmBackend, *, before: str | None = None) -> None:
    """Add (or replace) a backend; ``before`` puts it ahead of that backend in ``auto``'s order."""
    _REGISTRY.register(backend, before=before)


def grouped_gemm_backends() -> tuple[str, ...]:
    """The registered names, in ``auto``'s order."""
    return _REGISTRY.names()


def select_grouped_gemm_backend(
    x: torch.Tensor, w: torch.Tensor, backend: str | None = None
) -> GroupedGemmBackend:
    """``backend`` (else ``$LIGHTNING_D9D_GROUPED_GEMM``, else ``auto``) resolved for these inputs."""
    return _REGISTRY.select(
        backend, lambda b: b.preferred(x, w), lambda b: b.unsupported(x, w), "these inputs"
    )


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """``[T, K] x [G, K, N] -> [T, N]``, rows of ``x`` grouped consecutively by ``group_sizes``; see the module
    docstring for the backends and how one is chosen."""
    check_grouped_inputs(x, w, group_sizes)
    if torch.is_autocast_enabled(x.device.type):
        # A matmul under autocast: torch's grouped_mm is not on autocast's list (it refuses fp32 x bf16), so
        # cast here as autocast casts a Linear (bf16-mixed without FSDP keeps fp32 expert weights).
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    return select_grouped_gemm_backend(x, w, backend).run(x, w, group_sizes)


register_grouped_gemm_backend(
    GroupedGemmBackend("torch", torch_grouped_mm, _torch_unsupported, _torch_preferred)
)
register_grouped_gemm_backend(
    GroupedGemmBackend("grouped_gemm", package_grouped_mm, _package_unsupported, _package_preferred)
)
register_grouped_gemm_backend(
    GroupedGemmBackend("loop", loop_grouped_mm, _loop_unsupported, lambda x, w: True)
)
# Ours in Triton: by name only (``backend="triton"`` / $LIGHTNING_D9D_GROUPED_GEMM) until measured on a GPU.
register_grouped_gemm_backend(
    GroupedGemmBackend("triton", triton_grouped_mm, triton_unsupported, lambda x, w: False), before="loop"
)
# float8: by name only (it rounds the operands to e4m3); the FP8 plan names it for the experts it converts
register_grouped_gemm_backend(
    GroupedGemmBackend(
        FLOAT8_BACKEND, torchao_fp8_grouped_mm, fp8_grouped_gemm_unsupported, lambda x, w: False
    ),
    before="loop",
)
