"""Causal attention for a ``transformers`` model without the mask machinery's host sync.

Called without an ``attention_mask`` and without a cache (a pretraining batch), a ``transformers`` decoder
still runs its mask preparation (``masking_utils.create_causal_mask``): it checks the ``position_ids`` it built
itself for packed sequences (``find_packed_sequence_indices``), and that check reads a GPU value on the host in
every forward. The CPU then waits for the GPU at the start of each step, and what it queues next (FSDP's hooks,
the compiled layers' launches) is no longer hidden behind GPU work, and the step time varies from step to step.
The mask it would build is none anyway: for SDPA a plain causal mask is skipped in favour of ``is_causal``.

``transformers`` skips the whole preparation for an attention implementation that has no mask function of its
own (its rule for external backends). :func:`causal_attention_without_mask_sync` registers our causal attention
(:func:`causal_attention`) under :data:`CAUSAL_ATTENTION_NAME`, in the attention interface only, and a forward
pre-hook on the base model points the model's configs at it for a forward that passes no ``attention_mask``, no
cache (``past_key_values``, or ``cache`` as transformers 5.25 names it) and no packed ``position_ids`` of its own,
and back at ``"sdpa"`` for any other forward (padding masks, packed documents and generation keep the model's own
masks).

Our causal attention runs the attention backends of our own models
(:func:`~lightning_d9d.modules.attention.select_attention_backend`: ``auto`` takes cuDNN's SDPA on Hopper, or
whatever it prefers where another kernel is installed; ``$LIGHTNING_D9D_ATTENTION`` names one), so a
``transformers`` model trains on the same kernel as ours. What SDPA with ``is_causal=True`` computes, they compute
(on CPU ``auto`` is that very call, bit for bit); a call they do not compute exactly goes, unchanged, to
``transformers``' SDPA function as registered when the switch was installed: a mask, dropout, a softmax scale
other than ``1 / sqrt(head_dim)``, ``is_causal`` false, queries and keys of other lengths or head dims, or a
keyword that changes the math (:data:`MATH_KEYWORDS`: a soft cap, sinks, a sliding window, a position bias).

Packed rows (``position_ids`` restarting at 0 per document, no mask, no cache) take our documents' attention
instead (:data:`DOCUMENTS_ATTENTION_NAME`): the pre-hook builds the mask once per forward from the positions
(:func:`~lightning_d9d.modules.attention.document_attention_mask`: FlexAttention's block mask on CUDA for rows of
whole 128-token blocks, SDPA's dense ``[B, 1, T, T]`` mask elsewhere, ``$LIGHTNING_D9D_DOCUMENT_ATTENTION``) and
hands it to every attention call as the keyword :data:`DOCUMENT_MASK_KWARG`, which ``transformers`` passes from
the decoder through each layer to the attention function. ``transformers``' own packed path builds the dense mask
after a host sync per forward (``find_packed_sequence_indices``); ours has neither. Where the decoder's forward
takes no extra keywords, or attention dropout is on in training, packed rows keep ``transformers``' own path.

Only for models whose every config asks for ``"sdpa"`` and whose layers are all full attention (a sliding window
needs its mask). Under context parallelism the adapter registers its own attention instead (:mod:`.context`).

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_d9d.modules.attention import (
    document_attention,
    document_attention_mask,
    select_attention_backend,
)

CAUSAL_ATTENTION_NAME = "lightning_d9d_causal"
DOCUMENTS_ATTENTION_NAME = "lightning_d9d_documents"
DOCUMENT_MASK_KWARG = "d9d_document_mask"
#: ``0`` keeps ``transformers``' own packed path (its dense mask, after a host sync) for packed rows.
DOCUMENTS_ENV_VAR = "LIGHTNING_D9D_HF_DOCUMENT_ATTENTION"
SDPA = "sdpa"
# A forward given any of these keeps the model's own masks; "cache" is transformers' name for past_key_values
# from 5.25 (a chunk of several new tokens after a cache needs the mask: SDPA's is_causal aligns top-left).
MASKED = ("attention_mask", "past_key_values", "cache")
#: Keywords of ``transformers``' attention call that change what attention computes when given (not None): a logit
#: soft cap, attention sinks, a sliding window, a bias added to the logits, varlen boundaries of packed rows. Our
#: backends compute plain causal attention only, so a call with any of them keeps ``transformers``' SDPA function,
#: which applies or refuses each as it always did.
MATH_KEYWORDS = (
    "softcap",
    "s_aux",
    "sinks",
    "sliding_window",
    "position_bias",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
)
#: ``transformers``' attention-function signature: ``(module, query, key, value, attention_mask, dropout=...,
#: scaling=..., **kwargs) -> (out, weights)``.
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def causal_attention_without_mask_sync(model: nn.Module) -> bool:
    """Install the switch described in the module docstring on ``model`` (a ``transformers`` model or a pipeline
    stage of one); False, changing nothing, where it does not apply."""
    configs = _configs(model)
    if not configs or not all(_plain_causal(config) for config in configs):
        return False
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    registered = getattr(interface, "_global_mapping", None)
    if interface is None or not isinstance(registered, dict) or SDPA not in registered:
        return False
    # transformers' SDPA as registered now: what a call our backends cannot compute exactly falls back to
    interface.register(CAUSAL_ATTENTION_NAME, causal_attention(registered[SDPA]))
    interface.register(DOCUMENTS_ATTENTION_NAME, documents_attention_forward)
    base = getattr(model, "base_model", None)
    base = base if isinstance(base, nn.Module) else model
    base.register_forward_pre_hook(_CausalSwitch(base, configs), with_kwargs=True)
    return True


def _configs(model: nn.Module) -> list[Any]:
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(type(config), "_attn_implementation"):
            found[id(config)] = config
    return list(found.values())


def _plain_causal(config: Any) -> bool:
    if config._attn_implementation not in (SDPA, CAUSAL_ATTENTION_NAME):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    # no layer_types: a sliding window, where the config has one and uses it, needs its mask
    return (
        getattr(config, "sliding_window", None) is None
        or getattr(config, "use_sliding_window", True) is False
    )


class _CausalSwitch:
    """The base model's forward pre-hook: the configs at :data:`CAUSAL_ATTENTION_NAME` for a plain causal
    forward, at :data:`DOCUMENTS_ATTENTION_NAME` (with the documents' mask as a keyword) for packed rows, at
    ``"sdpa"`` otherwise."""

    def __init__(self, base: nn.Module, configs: list[Any]) -> None:
        self.configs = configs
        parameters = inspect.signature(base.forward).parameters.values()
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.index = {name: i for i, name in enumerate(names)}
        # the mask reaches the attention as a keyword the decoder hands on to its layers (**kwargs)
        self.takes_keywords = any(p.kind is p.VAR_KEYWORD for p in parameters)

    def _value(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        i = self.index.get(name)
        return args[i] if i is not None and i < len(args) else kwargs.get(name)

    def _documents(self, module: nn.Module) -> bool:
        """Whether packed rows may take our documents' attention (dropout in training would need its own)."""
        if not self.takes_keywords or os.environ.get(DOCUMENTS_ENV_VAR, "1") == "0":
            return False
        return not module.training or all(
            not getattr(config, "attention_dropout", 0.0) for config in self.configs
        )

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        masked = any(self._value(name, args, kwargs) is not None for name in MASKED)
        positions = self._value("position_ids", args, kwargs)
        result = None
        if masked:
            implementation = SDPA
        elif positions is None:
            implementation = CAUSAL_ATTENTION_NAME
        elif self._documents(module):
            implementation = DOCUMENTS_ATTENTION_NAME
            result = args, {**kwargs, DOCUMENT_MASK_KWARG: document_attention_mask(positions)}
        else:
            implementation = SDPA
        for config in self.configs:
            if config._attn_implementation != implementation:
                config._attn_implementation = implementation
        return result


def documents_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature (``[B, heads, T, head_dim]`` in, ``[B, T, heads,
    head_dim]`` out, no weights): causal attention within each document, by the mask the pre-hook built for
    this forward (:data:`DOCUMENT_MASK_KWARG`)."""
    mask = kwargs.get(DOCUMENT_MASK_KWARG)
    if mask is None:
        raise RuntimeError(
            f"{type(module).__name__}: packed rows reached the documents' attention without their mask (the "
            f"decoder did not hand the keyword {DOCUMENT_MASK_KWARG!r} to its layers); set "
            f"{DOCUMENTS_ENV_VAR}=0 to keep transformers' own packed path"
        )
    if dropout:
        raise RuntimeError(
            f"{type(module).__name__}: the documents' attention has no dropout (got {dropout})"
        )
    default = 1.0 / math.sqrt(query.shape[-1])
    scale = None if scaling is None or math.isclose(scaling, default, rel_tol=1e-6) else scaling
    out = document_attention(query, key, value, mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def causal_attention(fallback: AttentionFunction) -> AttentionFunction:
    """The attention function registered under :data:`CAUSAL_ATTENTION_NAME`: ``transformers``' signature
    (``[B, heads, T, head_dim]`` in, ``[B, T, heads, head_dim]`` contiguous out, no weights), run by our attention
    backends (:func:`~lightning_d9d.modules.attention.select_attention_backend`: ``auto``, or
    ``$LIGHTNING_D9D_ATTENTION``), so a ``transformers`` model takes the kernel our own models take.

    Every call our backends do not compute exactly is handed, unchanged, to ``fallback`` (``transformers``' SDPA
    function, captured when the switch was installed): see :func:`_ours`."""

    def forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not _ours(module, query, key, value, attention_mask, dropout, scaling, kwargs):
            return fallback(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        # chosen per call, which under torch.compile is at trace time: a plain function of the queries' device,
        # dtype and shape (and the environment), with no logging while tracing (the registry's rule)
        out = select_attention_backend(query).run(query, key, value)
        return out.transpose(1, 2).contiguous(), None

    return forward


def _ours(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> bool:
    """Whether our backends compute exactly what ``transformers``' SDPA function would for this call: causal
    attention of equally long queries and keys (more than one: SDPA drops ``is_causal`` for a single query) with no
    mask, no dropout, the default softmax scale, one head dim, and no keyword that changes the math."""
    if attention_mask is not None or dropout:
        return False
    # SDPA's rule: the call's is_causal, else the module's
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        return False
    length = query.shape[2]
    if length < 2 or key.shape[2] != length or value.shape[2] != length:
        return False
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim or query.shape[1] % key.shape[1]:
        return False
    # our backends scale by 1 / sqrt(head_dim); transformers' head_dim ** -0.5 may differ from it in the last bit of
    # the double only, below any float the kernels compute in
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(head_dim), rel_tol=1e-12):
        return False
    return all(kwargs.get(name) is None for name in MATH_KEYWORDS)
