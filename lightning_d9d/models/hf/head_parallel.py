"""Head-parallel context parallelism for a ``transformers`` model: the model's own attention function over the
whole sequence for this rank's heads.

Under ``context_attention="heads"`` the adapter's attention
(:func:`~.context_attention.context_attention_forward`) hands each call here.
:class:`~lightning_d9d.modules.head_parallel_attention.HeadParallelAttention` exchanges the rotated
``q``/``k``/``v`` (RoPE ran at each token's global position, :class:`~.context._GlobalPositions`) so that
this rank holds every position of ``heads / cp`` heads, and the function the model's config named before the
adapter replaced it (``"sdpa"``, or the family's own ``eager_attention_forward``, which computes Gemma 2's soft
cap and GPT-OSS's sinks) runs on them with the mask one process would give it: causal, within the layer's
sliding window, and the padding or packed documents' mask the adapter's pre-hook gathered for the whole sequence
(boolean for SDPA, additive for eager, as ``transformers`` builds them). A module's per-head parameters (GPT-OSS's
``sinks``) are cut to this rank's heads; its key/value groups are the exchanged heads'. The output goes back to
this rank's positions with the second all-to-all.

FlexAttention and the flash-attention kernels take masks (a block mask, varlen boundaries) built for the whole
sequence in their own formats: not yet; they are refused by name before any collective.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_d9d.modules.context_attention import window_band
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention

#: The attention implementations whose function head-parallel cp runs (masks built here in their format).
HEAD_PARALLEL_IMPLEMENTATIONS = ("sdpa", "eager")
#: The attribute each attention module holds its own attention function in: ``(implementation, function)``.
_OWN_ATTENTION = "_d9d_own_attention"

AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def keep_own_attention(model: nn.Module, attentions: list[nn.Module]) -> None:
    """Before the adapter points the configs at its own attention: each attention module keeps the function its
    config names now; refused (before any collective) where it is not one of :data:`HEAD_PARALLEL_IMPLEMENTATIONS`
    or where the family has no eager function."""
    name = type(model).__name__
    for module in attentions:
        config: Any = module.config
        implementation: str = config._attn_implementation
        if implementation not in HEAD_PARALLEL_IMPLEMENTATIONS:
            raise NotImplementedError(
                f"{name}: context_attention='heads' runs the model's own attention with a mask built for the "
                f"whole sequence, for {' and '.join(map(repr, HEAD_PARALLEL_IMPLEMENTATIONS))} so far; its config "
                f"asks for {implementation!r}: load the model with attn_implementation='sdpa' (or 'eager'), or "
                "use context_attention='all_gather'"
            )
        setattr(module, _OWN_ATTENTION, (implementation, _own_function(module, implementation)))


def _own_function(module: nn.Module, implementation: str) -> AttentionFunction:
    if implementation == "eager":
        # each family's modeling file has its own (Gemma 2's caps the logits, GPT-OSS's adds the sinks)
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:
            raise NotImplementedError(
                f"{type(module).__name__}: context_attention='heads' with attn_implementation='eager' needs its "
                f"modeling file ({type(module).__module__}) to define eager_attention_forward; use 'sdpa'"
            )
        return function  # type: ignore[no-any-return]
    interface: Any = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    if interface is None:
        raise ImportError(
            "head-parallel attention for a transformers model needs transformers.ALL_ATTENTION_FUNCTIONS"
        )
    return interface[implementation]  # type: ignore[no-any-return]


class _RankHeads:
    """``module`` as its attention function sees it on this rank: per-head parameters (``sinks``) cut to the
    rank's heads, ``num_key_value_groups`` as the exchanged query and key/value heads pair up; every other
    attribute is the module's."""

    def __init__(self, module: nn.Module, heads: slice, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor):
            self.sinks = sinks[heads]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def head_parallel_forward(
    module: nn.Module,
    attend: HeadParallelAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    **kwargs: Any,
) -> torch.Tensor:
    """``[B, heads, T / cp, head_dim]`` in (this rank's positions), ``[B, T / cp, heads, head_dim]`` out:
    the model's own attention function over the whole sequence for this rank's heads (the module's docstring).
    ``keys``: the mask the adapter's pre-hook passed, ``None``, the padding's ``[B, 1, 1, T]`` or the packed
    documents' ``[B, 1, T, T]``."""
    own = getattr(module, _OWN_ATTENTION, None)
    if own is None:
        raise RuntimeError(
            f"{type(module).__name__} runs head-parallel attention but kept no attention function of its own "
            "(parallelize_hf_context)"
        )
    implementation, function = own
    q, k, v = attend.to_heads(query, key, value)
    mine = attend.rank_heads(query.shape[1])
    sinks = kwargs.get("s_aux")
    if isinstance(sinks, torch.Tensor):
        kwargs["s_aux"] = sinks[mine]
    mask = whole_sequence_mask(
        keys, q.shape[2], q.device, sliding_window, additive=q.dtype if implementation == "eager" else None
    )
    rank_module = _RankHeads(module, mine, q.shape[1] // k.shape[1])
    out, _ = function(
        rank_module, q, k, v, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
    )  # [B, T, heads / cp, head_dim]
    return attend.to_sequence(out.transpose(1, 2)).transpose(1, 2).contiguous()


def whole_sequence_mask(
    keys: torch.Tensor | None,
    seq_len: int,
    device: torch.device,
    window: int | None = None,
    *,
    additive: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The mask one process gives a layer's attention over ``seq_len`` positions: causal, within a sliding
    ``window`` (:func:`~lightning_d9d.modules.context_attention.window_band`), and ``keys`` (the padding's
    ``[B, 1, 1, T]`` or the packed documents' ``[B, 1, T, T]``). Boolean (True attends) for SDPA, which takes
    ``None`` for the plain causal mask (its ``is_causal``); with ``additive`` the dtype of an additive mask (0 or
    the dtype's lowest value), which an eager attention adds to its logits. A query always sees itself: a padded
    one would otherwise see nothing (its output reaches no counted label)."""
    if keys is None and window is None and additive is None:
        return None
    positions = torch.arange(seq_len, device=device)
    allowed = positions[:, None] >= positions[None, :]
    if window is not None:
        allowed = allowed & window_band(positions, positions, window)
    if keys is not None:
        if (
            keys.dim() != 4
            or keys.shape[1] != 1
            or keys.shape[2] not in (1, seq_len)
            or keys.shape[3] != seq_len
        ):
            raise NotImplementedError(
                f"head-parallel attention takes a 2-D padding attention_mask ([batch, sequence]) or packed "
                f"position_ids, not a prepared {keys.dim()}-D mask {tuple(keys.shape)}"
            )
        itself = positions[:, None] == positions[None, :]
        allowed = allowed & (keys.to(torch.bool) | itself)
    if additive is None:
        return allowed if allowed.dim() == 4 else allowed[None, None]
    bias = torch.zeros(allowed.shape, dtype=additive, device=device).masked_fill(
        ~allowed, torch.finfo(additive).min
    )
    return bias if bias.dim() == 4 else bias[None, None]
