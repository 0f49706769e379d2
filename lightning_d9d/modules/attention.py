"""Causal grouped-query self-attention with optional per-head q/k norms (Qwen3), and the attention backends.

The attention block runs through a registry of backends, each ``run(q, k, v) -> out`` for causal attention on
``[B, heads, T, head_dim]`` with fewer (grouped) key/value heads. ``auto`` picks, per device and dtype, the
first backend of the registry's order that prefers these inputs; a name (``Attention.attention_backend`` or
``$LIGHTNING_D9D_ATTENTION``) forces one, refused with the reason when it cannot run them. The choice is logged
once per backend.

On an H200 (bf16, head dim 128, GQA 16/8, seq 2048-8192; docs/benchmarks.md) SDPA's cuDNN kernel with grouped
heads is the fastest of torch's (410-540 TFLOP/s forward+backward), flash is about half of it, memory-efficient
has no grouped-heads kernel (it needs the heads repeated) and math is 20x slower; FlashAttention 4
(``flash_attn4``, ``flash_attn.cute``: :mod:`lightning_d9d.kernels.flash_attn4`, the optional flash-attn-4
package) beats cuDNN there (438-539 TFLOP/s, 4-9 % less time). So CUDA bf16/fp16 takes ``flash_attn4`` on Hopper
where it is installed, then ``sdpa_cudnn`` (for head dims up to 128, where it was measured), then ``sdpa_flash``
(up to 256); everything else (CPU, fp32, head dims no kernel takes) plain ``sdpa``, which lets torch choose as
before. Each backend refuses, by name, the head dims torch's kernel would refuse. ``flash_attn`` (FlashAttention 2) runs when its package is installed and is preferred
only below Hopper. Other paths (e.g. a context-parallel one) join with :func:`register_attention_backend`.

Packed rows (:func:`document_attention_mask`) take FlexAttention's block mask, SDPA's dense mask, or, by name, the
varlen kernels of FlashAttention 4 or 2: the rows laid end to end as one batch of documents (``cu_seqlens``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lightning_d9d.kernels import flash_attn4 as fa4
from lightning_d9d.kernels.registry import BackendRegistry
from lightning_d9d.modules.documents import (
    BLOCK,
    document_block_mask,
    document_causal_mask,
    document_cu_seqlens,
    document_ids,
)
from lightning_d9d.modules.norm import RMSNorm
from lightning_d9d.modules.rope import apply_rotary


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv_heads, T, D] -> [B, kv_heads * groups, T, D]``, each kv head repeated for its query group."""
    if groups == 1:
        return x
    b, kv_heads, t, d = x.shape
    return x[:, :, None].expand(b, kv_heads, groups, t, d).reshape(b, kv_heads * groups, t, d)


ENV_VAR = "LIGHTNING_D9D_ATTENTION"
log = logging.getLogger("lightning_d9d.modules")
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ContextAttentionFn(Protocol):
    """What :attr:`Attention.context` holds: ``(q, k, v)`` or ``(q, k, v, document_mask)`` -> out (the
    context-parallel paths of :mod:`~lightning_d9d.modules.context_attention`, which imports this module)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class HeadParallelContext(ABC):
    """A context-parallel path that splits attention by heads instead of by queries (what :attr:`Attention.context`
    may hold, besides a :class:`ContextAttentionFn`): :meth:`to_heads` turns this rank's part of the sequence, every
    head, into the whole sequence of some heads, the block's own attention runs on them as in one process (its
    backend, its document mask), and :meth:`to_sequence` turns the output back (:mod:`~lightning_d9d.modules.
    head_parallel_attention`, which imports this module)."""

    @abstractmethod
    def to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, heads, T / cp, D]`` at this rank's positions -> ``[B, heads / cp, T, D]`` in sequence order."""

    @abstractmethod
    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, heads / cp, T, D]`` in sequence order -> ``[B, heads, T / cp, D]`` at this rank's positions."""


@dataclass(frozen=True)
class AttentionBackend:
    """``run(q, k, v)``: causal attention, ``q`` ``[B, H, T, D]``, ``k``/``v`` ``[B, H_kv, T, D]`` with
    ``H_kv`` dividing ``H``. ``unsupported`` says why it cannot run these inputs (None: it can); ``preferred``
    whether ``auto`` takes it for them."""

    name: str
    run: AttentionFn
    unsupported: Callable[[torch.Tensor], str | None]
    preferred: Callable[[torch.Tensor], bool]


def _sdpa_with(backend: SDPBackend | None, *, repeat_heads: bool = False) -> AttentionFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if repeat_heads and groups > 1:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        gqa = groups > 1 and not repeat_heads
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def _half_on_cuda(q: torch.Tensor, min_capability: int) -> str | None:
    if not q.is_cuda:
        return f"runs on CUDA only, got {q.device}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"runs bf16/fp16 only, got {q.dtype}"
    if torch.cuda.get_device_capability(q.device)[0] < min_capability:
        return f"needs compute capability >= {min_capability}.0"
    return None


def _head_dim_over(q: torch.Tensor, largest: int) -> str | None:
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > largest:
        return f"takes head dims in multiples of 8 up to {largest}, got {head_dim}"
    return None


def _cudnn_unsupported(q: torch.Tensor) -> str | None:
    """torch 2.11's rule for cuDNN attention (``check_cudnn_tensor_shapes``): head dims in multiples of 8 up to 256
    on compute capability 9.0 (with cuDNN >= 9.10, which its CUDA 12.8+ builds ship), up to 128 elsewhere."""
    reason = _half_on_cuda(q, 8)
    if reason is not None:
        return reason
    return _head_dim_over(q, 256 if tuple(torch.cuda.get_device_capability(q.device)) == (9, 0) else 128)


def _cudnn_preferred(q: torch.Tensor) -> bool:
    # measured fastest on Hopper at head dim 128 (docs/benchmarks.md); sm80, and head dims above 128, keep flash
    return _half_on_cuda(q, 9) is None and _head_dim_over(q, 128) is None


def _torch_flash_unsupported(q: torch.Tensor) -> str | None:
    """torch's flash kernel: sm80+, half precision, head dims in multiples of 8 up to 256."""
    return _half_on_cuda(q, 8) or _head_dim_over(q, 256)


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    function = importlib.import_module("flash_attn").flash_attn_func
    # flash-attn takes [B, T, heads, D] and grouped key/value heads as they are.
    out: torch.Tensor = function(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


def _flash_attn_2_installed() -> bool:
    # flash-attn 2's compiled extension, not the flash_attn package: FA4's wheel installs a flash_attn package too
    # (holding only flash_attn.cute), with no flash_attn_func in it
    return importlib.util.find_spec("flash_attn_2_cuda") is not None


# Looked up once at import: Dynamo refuses to trace importlib's find_spec, and a compiled block whose queries
# are fp32 (under autocast) reaches this check when the backend is chosen inside the graph.
_FLASH_ATTN_INSTALLED = _flash_attn_2_installed()


def _flash_attn_unsupported(q: torch.Tensor) -> str | None:
    if not _FLASH_ATTN_INSTALLED:
        return "needs the flash-attn (2) package, which is not installed"
    return _half_on_cuda(q, 8)


def _flash_attn4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # FA4 takes [B, T, heads, D]: the block's q/k/v are transposed views of that layout (no copy)
    return fa4.flash_attn4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


_REGISTRY: BackendRegistry[AttentionBackend] = BackendRegistry(
    "attention", ENV_VAR, fallback="sdpa", hint="Attention.attention_backend", log=log
)


def register_attention_backend(backend: AttentionBackend, *, before: str | None = None) -> None:
    """Add (or replace) a backend; ``before`` puts it ahead of that one in ``auto``'s order."""
    _REGISTRY.register(backend, before=before)


def attention_backends() -> tuple[str, ...]:
    """The registered names, in ``auto``'s order."""
    return _REGISTRY.names()


def select_attention_backend(q: torch.Tensor, name: str | None = None) -> AttentionBackend:
    """``name`` (else ``$LIGHTNING_D9D_ATTENTION``, else ``auto``) resolved for queries like ``q``."""

    def unsupported(backend: AttentionBackend) -> str | None:
        reason = backend.unsupported(q)
        return None if reason is None else f"it {reason}"

    return _REGISTRY.select(name, lambda b: b.preferred(q), unsupported, f"{q.dtype} queries on {q.device}")


def _never(q: torch.Tensor) -> bool:
    return False


def _can_always(q: torch.Tensor) -> str | None:
    return None


def _flash_attn4_preferred(q: torch.Tensor) -> bool:
    """FA4 where it runs on Hopper: on an H200 (docs/benchmarks.md, run G4) its forward + backward takes 1.79 ms
    against cuDNN's 1.94 at the 0.6B block's shape (seq 4096 x 4) and the compiled 0.6B step 176.4 ms against
    180.2; on an H100 the step 181.0 ms against 186.5 (run U1). Blackwell is not measured, so there it stays by
    name only."""
    return fa4.flash_attn4_unsupported(q) is None and torch.cuda.get_device_capability(q.device)[0] == 9


# First in auto's order where the flash-attn-4 package is installed (an optional extra); cuDNN otherwise.
register_attention_backend(
    AttentionBackend("flash_attn4", _flash_attn4, fa4.flash_attn4_unsupported, _flash_attn4_preferred)
)
register_attention_backend(
    AttentionBackend(
        "sdpa_cudnn",
        _sdpa_with(SDPBackend.CUDNN_ATTENTION),
        _cudnn_unsupported,
        _cudnn_preferred,
    )
)
register_attention_backend(
    AttentionBackend(
        "flash_attn", _flash_attn, _flash_attn_unsupported, lambda q: _flash_attn_unsupported(q) is None
    )
)
register_attention_backend(
    AttentionBackend(
        "sdpa_flash",
        _sdpa_with(SDPBackend.FLASH_ATTENTION),
        _torch_flash_unsupported,
        lambda q: _torch_flash_unsupported(q) is None,
    )
)
register_attention_backend(
    AttentionBackend(
        "sdpa_efficient",
        _sdpa_with(SDPBackend.EFFICIENT_ATTENTION, repeat_heads=True),  # no grouped-heads kernel
        lambda q: None if q.is_cuda else f"runs on CUDA only, got {q.device}",
        _never,
    )
)
register_attention_backend(AttentionBackend("sdpa_math", _sdpa_with(SDPBackend.MATH), _can_always, _never))
register_attention_backend(AttentionBackend("sdpa", _sdpa_with(None), _can_always, _never))


DOCUMENT_ENV_VAR = "LIGHTNING_D9D_DOCUMENT_ATTENTION"
#: The varlen paths for packed rows, by name only until an H200 measures them against FlexAttention: FlashAttention
#: 4's (``flash_attn.cute``) and 2's ``flash_attn_varlen_func`` on the rows laid end to end.
VARLEN_DOCUMENT_ATTENTION = ("flash_attn4", "flash_attn")
#: The attention paths for packed rows: ``flex`` (FlexAttention on the block-sparse mask), ``sdpa`` (SDPA with the
#: dense ``[B, 1, T, T]`` mask), the varlen kernels, ``auto``.
DOCUMENT_ATTENTION = ("auto", "flex", "sdpa", *VARLEN_DOCUMENT_ATTENTION)


@dataclass(frozen=True)
class VarlenDocuments:
    """Packed rows as one batch of documents for a varlen kernel: the ``[B, T]`` rows laid end to end into ``B * T``
    tokens, document ``i`` at ``cu_seqlens[i]:cu_seqlens[i + 1]`` (int32, on the rows' device), none longer than
    ``max_seqlen``; ``kernel`` is one of :data:`VARLEN_DOCUMENT_ATTENTION`."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    kernel: str


DocumentMask = torch.Tensor | BlockMask | VarlenDocuments
_document_logged: set[str] = set()


def _varlen_unsupported(kernel: str, position_ids: torch.Tensor) -> str | None:
    """Why the varlen path ``kernel`` cannot take these rows, as far as their positions tell (the queries' dtype
    and head dim are checked when attention runs)."""
    if kernel == "flash_attn4" and not fa4.INSTALLED:
        return "needs the flash-attn-4 package (flash_attn.cute), which is not installed"
    if kernel == "flash_attn" and not _FLASH_ATTN_INSTALLED:
        return "needs the flash-attn (2) package, which is not installed"
    if not position_ids.is_cuda:
        return f"runs on CUDA only, got {position_ids.device}"
    major, minor = torch.cuda.get_device_capability(position_ids.device)
    needed = 9 if kernel == "flash_attn4" else 8
    if major < needed:
        return f"needs compute capability >= {needed}.0, got {major}.{minor}"
    return None


def document_attention_path(position_ids: torch.Tensor, name: str | None = None) -> str:
    """The path of :data:`DOCUMENT_ATTENTION` for packed rows of ``position_ids`` (``name``, else
    ``$LIGHTNING_D9D_DOCUMENT_ATTENTION``, else ``auto``), refusing with the reason a path that cannot run them.
    ``auto`` takes FlexAttention on CUDA for rows whose length is a multiple of its block (it skips the tiles that
    cross no document and needs no ``[T, T]`` mask: faster on an H200, docs/packing.md) and the dense mask elsewhere
    (CPU: torch has no FlexAttention backward there); never a varlen kernel (not measured yet)."""
    asked = name or os.environ.get(DOCUMENT_ENV_VAR) or "auto"
    if asked not in DOCUMENT_ATTENTION:
        raise ValueError(
            f"document attention {asked!r} (${DOCUMENT_ENV_VAR} or the name given): choose one of "
            f"{', '.join(map(repr, DOCUMENT_ATTENTION))}"
        )
    length = position_ids.shape[-1]
    if asked == "flex":
        if length % BLOCK != 0:
            raise ValueError(
                f"document attention 'flex' needs rows whose length is a multiple of {BLOCK}, got {length}: pad "
                f"the rows (pack_documents(seq_len=...)) to a multiple of {BLOCK}, or choose 'sdpa'"
            )
        if position_ids.device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError(
                "document attention 'flex' cannot train on CPU (torch's FlexAttention has no CPU backward): "
                "choose 'sdpa' (or 'auto')"
            )
    if asked in VARLEN_DOCUMENT_ATTENTION:
        reason = _varlen_unsupported(asked, position_ids)
        if reason is not None:
            raise ValueError(
                f"document attention {asked!r} cannot run these rows: it {reason}; choose 'auto'"
            )
    chosen = asked
    if asked == "auto":
        chosen = "flex" if position_ids.is_cuda and length % BLOCK == 0 else "sdpa"
    if chosen not in _document_logged:
        _document_logged.add(chosen)
        log.info("attention for packed rows: %s (%s)", chosen, "asked for" if asked != "auto" else "auto")
    return chosen


def document_attention_mask(position_ids: torch.Tensor, name: str | None = None) -> DocumentMask:
    """The mask every layer of one forward attends packed rows with (built once per forward): FlexAttention's
    :class:`BlockMask`, SDPA's dense ``[B, 1, T, T]`` boolean mask, or a varlen kernel's :class:`VarlenDocuments`
    (:func:`document_attention_path`; its ``cu_seqlens`` cost one host synchronisation)."""
    if position_ids.dim() != 2 or position_ids.is_floating_point():
        raise ValueError(
            f"position_ids of a packed batch must be an integer [batch, sequence] tensor, got "
            f"{position_ids.dtype} of shape {tuple(position_ids.shape)}"
        )
    path = document_attention_path(position_ids, name)
    if path in VARLEN_DOCUMENT_ATTENTION:
        cu_seqlens, max_seqlen = document_cu_seqlens(position_ids)
        return VarlenDocuments(cu_seqlens, max_seqlen, path)
    documents = document_ids(position_ids)
    if path == "flex":
        return document_block_mask(documents)
    return document_causal_mask(documents)


# FlexAttention runs fused only compiled; a compiled block traces it itself, an eager one calls this.
_compiled_flex_attention: Callable[..., torch.Tensor] | None = None


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float | None = None
) -> torch.Tensor:
    global _compiled_flex_attention
    gqa = q.shape[1] != k.shape[1]
    if torch.compiler.is_compiling() or not q.is_cuda:  # on CPU: torch's unfused reference (forward only)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)  # type: ignore[return-value]
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: VarlenDocuments, scale: float | None
) -> torch.Tensor:
    batch, heads, length, _ = q.shape
    kernel = documents.kernel
    unsupported = fa4.flash_attn4_unsupported if kernel == "flash_attn4" else _flash_attn_unsupported
    reason = unsupported(q)
    if reason is not None:
        raise ValueError(
            f"document attention {kernel!r} cannot run {q.dtype} queries of head dim {q.shape[-1]} on {q.device}: "
            f"it {reason}; choose another with ${DOCUMENT_ENV_VAR}"
        )
    # [B, heads, T, D] -> [B * T, heads, D]: the rows end to end, as cu_seqlens counts them (no copy when q/k/v are
    # transposed views of [B, T, heads, D], as the blocks' are)
    fq, fk, fv = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (q, k, v))
    cu, longest = documents.cu_seqlens, documents.max_seqlen
    if kernel == "flash_attn4":
        out = fa4.flash_attn4_varlen(fq, fk, fv, cu, longest, scale)
    else:
        function = importlib.import_module("flash_attn").flash_attn_varlen_func
        out = function(fq, fk, fv, cu, cu, longest, longest, softmax_scale=scale, causal=True)
    return out.view(batch, length, heads, -1).transpose(1, 2)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_mask: DocumentMask,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each document of a packed row, ``document_mask`` from
    :func:`document_attention_mask`: FlexAttention on its block mask, SDPA with the dense boolean mask, exact
    on every device (torch picks the kernel that takes a mask: on CPU its fused kernel, on CUDA the
    memory-efficient one), or a varlen kernel on :class:`VarlenDocuments` (CUDA). ``scale``: the softmax scale,
    ``None`` for ``1 / sqrt(head_dim)``."""
    if isinstance(document_mask, BlockMask):
        return _flex(q, k, v, document_mask, scale)
    if isinstance(document_mask, VarlenDocuments):
        return _varlen(q, k, v, document_mask, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


class Attention(nn.Module):
    """Causal self-attention with ``num_kv_heads`` key/value heads shared by groups of query heads.

    With ``qk_norm`` each query and key head is RMS-normalised (one weight of size ``head_dim`` shared by all
    heads) before RoPE, as Qwen3 does. Grouped key/value heads go to SDPA as they are (``enable_gqa``):
    repeating them first cost 1.8 GiB and 4% of forward time on the Qwen3-0.6B shape on an H200
    (docs/benchmarks.md). ``repeat_kv_heads=True`` repeats them instead, for attention paths that need equal
    head counts (torch's context-parallel SDPA).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, device=device)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, device=device)
        self.q_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, device=device) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, device=device) if qk_norm else None
        self.repeat_kv_heads = False
        # A registered backend's name, or None for $LIGHTNING_D9D_ATTENTION / automatic selection.
        self.attention_backend: str | None = None
        # Set by a context-parallel plan: attends this rank's queries to the whole sequence's keys and values (a
        # ContextAttentionFn of modules/context_attention.py, which also takes a packed batch's document mask), or
        # splits the heads over the cp ranks around this block's own attention (a HeadParallelContext); None
        # attends within the local sequence.
        self.context: ContextAttentionFn | HeadParallelContext | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_mask: DocumentMask | None = None
    ) -> torch.Tensor:
        """``x``: ``[B, T, hidden]``; ``cos``/``sin``: ``[B or 1, T, head_dim]``. Returns ``[B, T, hidden]``.
        ``document_mask``: a packed batch's mask (:func:`document_attention_mask`): each token attends only the
        earlier tokens of its own document. Under context parallelism ``T`` is this rank's part and the mask the
        dense ``[B, 1, T, T * cp]``: its queries' rows of the one-process mask; under head-parallel context
        parallelism (a :class:`HeadParallelContext`) the one-process mask of the whole sequence, any kind."""
        b, t, _ = x.shape
        # -1 instead of the configured head counts: under tensor parallelism each rank holds only some heads.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)  # under cp at each token's true position: before any exchange
        context = self.context
        if isinstance(context, HeadParallelContext):
            q, k, v = context.to_heads(q, k, v)
            out = context.to_sequence(self._attend(q, k, v, document_mask))
        elif context is not None:
            # run_decoder builds the dense rows under cp
            if isinstance(document_mask, BlockMask | VarlenDocuments):
                kind = type(document_mask).__name__
                raise TypeError(f"context-parallel attention takes the dense document mask, not a {kind}")
            # keyword only when given: a path registered elsewhere may take (q, k, v) alone
            out = context(q, k, v) if document_mask is None else context(q, k, v, document_mask)
        else:
            out = self._attend(q, k, v, document_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_mask: DocumentMask | None
    ) -> torch.Tensor:
        """This block's own attention over whole sequences: ``[B, heads, T, D]`` (``k``/``v`` grouped) -> the
        same shape, causal or within each document of ``document_mask``."""
        if isinstance(document_mask, torch.Tensor) and document_mask.shape[-2] != q.shape[2]:
            raise ValueError(
                f"a document mask of {document_mask.shape[-2]} query rows for {q.shape[2]} queries: under "
                "head-parallel context parallelism the model builds the whole sequence's mask "
                "(ContextSplitAware.context_heads, set by parallelize_context)"
            )
        if document_mask is not None:
            if self.repeat_kv_heads:
                raise ValueError(
                    "packed documents (position_ids that restart per document) with repeat_kv_heads=True (torch's "
                    "context-parallel SDPA, which takes no mask): use lightning_d9d's context parallelism "
                    "(parallelize_context), which takes the document mask, or cp=1"
                )
            return document_attention(q, k, v, document_mask)
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and self.repeat_kv_heads:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        # Repeated heads mark torch's context-parallel SDPA, which dispatches on plain SDPA: left to torch.
        name = self.attention_backend or ("sdpa" if self.repeat_kv_heads else None)
        return select_attention_backend(q, name).run(q, k, v)
