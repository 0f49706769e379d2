"""FlashAttention 4 (the optional ``flash-attn-4`` package, module ``flash_attn.cute``: CuTe-DSL kernels compiled
on their first call, forward and backward on Hopper and Blackwell) as torch custom operators.

FA4 calls its kernels from Python through the CuTe DSL's own runtime, which ``torch.compile`` cannot trace: wrapped
as ``lightning_d9d::flash_attn4_forward`` / ``_backward`` (with fake kernels that give the outputs' shapes, and
the backward registered as the forward's autograd), a compiled block holds each call as one opaque node and
compiles whole (``fullgraph=True``).

Layouts are FA4's: ``[B, T, heads, D]`` for rows of equal length, or ``[total, heads, D]`` with ``cu_seqlens``
(``[n + 1]`` int32 offsets of ``n`` sequences laid end to end: packed documents). Grouped key/value heads are
taken as they are. The forward also returns the softmax's log-sum-exp (fp32, ``[B, heads, T]`` or
``[heads, total]``), which the backward reads; it is not differentiable here. Attention is causal.

The package is looked for once, without importing it (:data:`INSTALLED`); the kernels are imported at the first
call. Which inputs it takes (:func:`flash_attn4_unsupported`) follows the checks of ``flash_attn.cute.interface``
(``_validate_head_dims``, the backward's architectures) for the version ``benchmarks/carry_fa4.py`` carries
(4.0.0b40).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from types import ModuleType
from typing import Any

import torch


def _has_cute(package: str) -> bool:
    """Whether ``package`` is installed with a ``cute`` subpackage, found without importing either."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return False
    return any(
        os.path.isfile(os.path.join(p, "cute", "__init__.py")) for p in spec.submodule_search_locations
    )


def _cute_installed() -> bool:
    """Whether FA4 can run: ``flash_attn.cute`` and the CuTe DSL it is written in (``cutlass.cute``, from
    ``nvidia-cutlass-dsl``), found without importing ``flash_attn`` (flash-attn 2's ``flash_attn/__init__.py``
    loads its CUDA extension on import; FA4's wheel ships ``flash_attn`` as a namespace package holding ``cute``
    only). flash-attn 2.8's own package carries ``flash_attn/cute`` too, without the DSL: with it alone installed,
    ``auto`` would choose FA4 and its first call raise ``No module named 'cutlass'``."""
    return _has_cute("flash_attn") and _has_cute("cutlass")


# Looked up once at import: Dynamo refuses to trace importlib's find_spec, and the registry asks inside compiled
# blocks.
INSTALLED = _cute_installed()
#: The architectures whose head-dim limits and backward this module knows (FA4's sm90 and sm100/sm110 kernels).
CHECKED_MAJORS = (9, 10, 11)


def flash_attn4_unsupported(q: torch.Tensor) -> str | None:
    """Why FA4 cannot run causal attention on queries like ``q`` (``[..., D]``), or None when it can."""
    if not INSTALLED:
        return "needs the flash-attn-4 package (flash_attn.cute), which is not installed"
    if not q.is_cuda:
        return f"runs on CUDA only, got {q.device}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"runs bf16/fp16 only (with a backward), got {q.dtype}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 9:
        return f"needs compute capability >= 9.0 (FA4 has no backward below Hopper), got {major}.{minor}"
    if major not in CHECKED_MAJORS:
        return f"is wired for compute capability 9.x-11.x only (Hopper, Blackwell), got {major}.{minor}"
    head_dim = q.shape[-1]
    # 16-byte rows (8 bf16/fp16 elements); sm90: 8..256; sm100/sm110: 8..128, or 256
    fits = head_dim % 8 == 0 and (
        8 <= head_dim <= 256 if major == 9 else 8 <= head_dim <= 128 or head_dim == 256
    )
    if not fits:
        limits = "8 to 256" if major == 9 else "8 to 128, or 256"
        return (
            f"takes head dims of {limits} in multiples of 8 on compute capability {major}.x, got {head_dim}"
        )
    return None


def _interface() -> ModuleType:
    """FA4's interface module: its public ``flash_attn_func`` / ``flash_attn_varlen_func`` and its backward,
    ``_flash_attn_bwd``, which it exposes under no public name (our backward calls it as FA4's own autograd does)."""
    return importlib.import_module("flash_attn.cute.interface")


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("lightning_d9d::flash_attn4_forward", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    fa = _interface()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if cu_seqlens is None:
        out, lse = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    else:
        out, lse = fa.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=scale,
            causal=True,
            return_lse=True,
        )
    return out, lse


@_forward.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # fresh contiguous tensors, as FA4 allocates them: out takes v's head dim, the log-sum-exp is fp32
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(_lse_shape(q, cu_seqlens is not None), dtype=torch.float32)


@torch.library.custom_op("lightning_d9d::flash_attn4_backward", mutates_args=())
def _backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    varlen: dict[str, Any] = {}
    if cu_seqlens is not None:
        varlen = dict(
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen
        )
    dq, dk, dv = _interface()._flash_attn_bwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        grad.contiguous(),
        lse.contiguous(),
        softmax_scale=scale,
        causal=True,
        **varlen,
    )
    return dq, dk, dv


@_backward.register_fake
def _(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # contiguous, as FA4 allocates them (like its contiguous inputs); never the inputs' strides
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale
    ctx.mark_non_differentiable(lse)


def _grad(ctx: Any, grad: torch.Tensor, _lse_grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def flash_attn4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention, ``q`` ``[B, T, H, D]``, ``k``/``v`` ``[B, T, H_kv, D]`` (``H_kv`` dividing ``H``) ->
    ``[B, T, H, D]``; ``scale`` the softmax scale (None: ``1 / sqrt(D)``). Inputs are made contiguous first (FA4's
    outputs, and so the fake kernels', are contiguous whatever the inputs' layout)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _forward(q, k, v, None, 0, _scale(q.shape[-1], scale))[0]  # 0: no sequence bound needed


def flash_attn4_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each of the sequences laid end to end in ``q`` ``[total, H, D]`` and ``k``/``v``
    ``[total, H_kv, D]``: sequence ``i`` holds rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` (int32, ``cu_seqlens[0] =
    0``, ``cu_seqlens[-1] = total``), none longer than ``max_seqlen``. Returns ``[total, H, D]``."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _forward(q, k, v, cu_seqlens, max_seqlen, _scale(q.shape[-1], scale))[0]
