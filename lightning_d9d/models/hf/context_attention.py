"""The attention function a ``transformers`` model runs under context parallelism (:mod:`.context` plugs it in
through ``transformers``' attention interface and hands each attention module its path).

:func:`context_attention_forward` takes this rank's rotated ``q``/``k``/``v`` (``[B, heads, T / cp, head_dim]``)
and runs the module's path: the all-gather path with the load-balanced global causal mask (a sliding window as a
band, a padding or packed documents' mask, an attention logit soft cap, attention sinks as one more key:
:func:`_attention_with_sinks`), torch's ring kernels on CUDA, the model's own attention function between the
head-parallel exchanges (:mod:`.head_parallel`), or, where cp does not divide the query heads, the all-gather path
between them (:mod:`~lightning_d9d.modules.hybrid_attention`).

Nothing here imports ``transformers``: the interface is taken from the already loaded ``transformers.modeling_utils``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_d9d.models.hf.head_parallel import head_parallel_forward
from lightning_d9d.modules.context_attention import AllGatherAttention, TorchRingAttention, masked_attention
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention
from lightning_d9d.modules.hybrid_attention import HybridHeadParallelAttention

#: The name our context-parallel attention is registered under in ``transformers``' attention interface.
CONTEXT_ATTENTION_NAME = "lightning_d9d_context"
#: The attribute each attention module of a cp-parallelized model holds its context-parallel attention in.
ATTEND_ATTRIBUTE = "_d9d_context_attention"


def register_context_attention() -> None:
    """Register :func:`context_attention_forward` in ``transformers``' attention interface (idempotent)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling, "AttentionInterface", None)
    if interface is None:
        raise ImportError(
            "context parallelism for a transformers model needs transformers.AttentionInterface"
        )
    interface.register(CONTEXT_ATTENTION_NAME, context_attention_forward)


def context_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function ``transformers`` calls (``[B, heads, T / cp, head_dim]`` in, ``[B, T / cp, heads,
    head_dim]`` out, no weights): this rank's queries against the whole sequence, by global position (or, head-
    parallel, the model's own attention over the whole sequence for this rank's heads)."""
    attend = getattr(module, ATTEND_ATTRIBUTE, None)
    if attend is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attention {CONTEXT_ATTENTION_NAME!r} but was not parallelized for "
            "context parallelism (parallelize_hf_context)"
        )
    if dropout:
        raise NotImplementedError(f"context-parallel attention has no dropout (got dropout={dropout})")
    if isinstance(attend, HeadParallelAttention):
        out = head_parallel_forward(
            module, attend, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs
        )
        return out, None
    if isinstance(attend, HybridHeadParallelAttention):
        # this rank's heads of its head group's positions, then the all-gather path over the key group
        mine = attend.rank_heads(query.shape[1])
        query, key, value = attend.to_heads(query, key, value)
        sinks = kwargs.get("s_aux")
        if isinstance(sinks, torch.Tensor):
            kwargs["s_aux"] = sinks[mine]
        rows = None if attention_mask is None else attend.group_rows(attention_mask)
        out = _all_gather_forward(
            module, attend.gather, query, key, value, rows, scaling, sliding_window, kwargs
        )
        return attend.to_sequence(out).transpose(1, 2).contiguous(), None
    out = _all_gather_forward(
        module, attend, query, key, value, attention_mask, scaling, sliding_window, kwargs
    )
    return out.transpose(1, 2).contiguous(), None


def _all_gather_forward(
    module: nn.Module,
    attend: AllGatherAttention | TorchRingAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """This rank's queries against the whole sequence's keys (all-gather or torch's ring path):
    ``[B, heads, T / cp, head_dim]`` in and out."""
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    head_dim = query.shape[-1]
    if (sinks is not None or softcap is not None) and not isinstance(attend, AllGatherAttention):
        # parallelize_hf_context chose all_gather for them
        raise NotImplementedError(
            f"attention sinks or a logit soft cap under {attend!r}: use context_attention='all_gather'"
        )
    if sinks is not None and isinstance(attend, AllGatherAttention):
        if softcap is not None:
            raise NotImplementedError(
                f"{type(module).__name__}: context-parallel attention with both sinks and a logit soft cap "
                f"(softcap={softcap}); use cp=1"
            )
        scale = head_dim**-0.5 if scaling is None else scaling
        return _attention_with_sinks(attend, query, key, value, attention_mask, sinks, scale, sliding_window)
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-12):
        query = query * (scaling * math.sqrt(head_dim))  # our kernels scale by 1 / sqrt(head_dim)
    if attention_mask is None:
        if isinstance(attend, AllGatherAttention):
            return attend(query, key, value, window=sliding_window, softcap=softcap)
        return attend(
            query, key, value, window=sliding_window
        )  # torch's ring path: no soft cap (refused above)
    if isinstance(attend, AllGatherAttention):
        return _masked_attention(attend, query, key, value, attention_mask, sliding_window, softcap)
    raise NotImplementedError(
        f"an attention_mask under {attend!r}: torch's ring kernels know only the causal mask; pass no "
        "attention_mask (pad with labels = -100), or D9DStrategy(context_attention='all_gather')"
    )


def _masked_attention(
    attend: AllGatherAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """All-gather attention with the global causal mask (within ``window``) and ``keys``
    (:func:`_mask_with_keys`), the logits capped at ``softcap``."""
    mask = _mask_with_keys(attend, q, keys, window)
    k_all, v_all = attend.gather_sequence(k), attend.gather_sequence(v)
    return masked_attention(q, k_all, v_all, mask, softcap=softcap)


def _attention_with_sinks(
    attend: AllGatherAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """All-gather attention whose softmax per head also holds a sink logit (``sinks``, ``[heads]``) that no value
    goes with, as ``transformers`` computes it (the logits and the sink softmaxed together, the sink's share
    dropped). That is attention over one key more, whose logit is the sink and whose value is zero: ``q`` gets
    the sink as an extra feature, every key a 0 there and the extra key a 1, so one SDPA call (and its backward)
    computes it exactly, the sinks' gradient included. The causal mask (within ``window``), or ``keys``
    (:func:`_mask_with_keys`), masks the real keys; every query sees the sink."""
    batch, heads, local_len, _ = q.shape
    k_all, v_all = attend.gather_sequence(k), attend.gather_sequence(v)
    if keys is None:
        mask = attend.causal_mask(local_len, q.device, window)
    else:
        mask = _mask_with_keys(attend, q, keys, window)
    sink_logits = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, local_len, 1)
    q_sink = torch.cat((q * scale, sink_logits), dim=-1)
    k_sink = F.pad(k_all, (0, 1))  # a 0 in the sink's feature
    sink_key = F.pad(k_sink.new_zeros((*k_sink.shape[:2], 1, k_sink.shape[-1] - 1)), (0, 1), value=1.0)
    k_sink = torch.cat((k_sink, sink_key), dim=2)
    v_sink = F.pad(v_all, (0, 0, 0, 1))  # the sink's value: zeros
    mask = F.pad(mask, (0, 1), value=True)
    gqa = heads != k.shape[1]
    return F.scaled_dot_product_attention(q_sink, k_sink, v_sink, attn_mask=mask, scale=1.0, enable_gqa=gqa)


def _mask_with_keys(
    attend: AllGatherAttention, q: torch.Tensor, keys: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The global causal mask (within a sliding ``window``) and ``keys``: the key padding mask (``[B, 1, 1, T]``)
    or the packed documents' mask of this rank's queries (``[B, 1, T / cp, T]``), both from
    :class:`_GlobalPositions`; ``[B, 1, T / cp, T]``. Within a document the distance of two tokens in the row is
    that of their positions, so the window applies per document as ``transformers`` applies it to packed rows.
    A query always sees itself: a padded one would otherwise see nothing (its output reaches no counted label)."""
    local_len = q.shape[2]
    seq_len = local_len * attend.split.cp
    if (
        keys.dim() != 4
        or keys.shape[1] != 1
        or keys.shape[2] not in (1, local_len)
        or keys.shape[-1] != seq_len
    ):
        raise NotImplementedError(
            f"context-parallel attention takes a 2-D padding attention_mask ([batch, sequence]), not a prepared "
            f"{keys.dim()}-D mask {tuple(keys.shape)}"
        )
    causal = attend.causal_mask(local_len, q.device, window)  # [T / cp, T]
    query_positions = attend.split.local_positions(local_len, device=q.device)
    itself = query_positions[:, None] == torch.arange(seq_len, device=q.device)[None, :]
    return causal & (keys.to(torch.bool) | itself)  # [B, 1, T / cp, T]
