"""Context parallelism for a ``transformers`` causal LM: our load-balanced sequence split and exact attention,
plugged in through ``transformers``' attention interface, without touching the model's code.

Under cp each rank holds chunks ``r`` and ``2cp - 1 - r`` of every sequence (the strategy's ``model_loss`` cuts
the batch, :func:`~lightning_d9d.plans.split_batch`). Everything in a decoder but attention is position-wise, so
the model runs on the local tokens unchanged, except for three things :func:`parallelize_hf_context` changes:

- attention: ``transformers.AttentionInterface.register(CONTEXT_ATTENTION_NAME, fn)`` and every config of the
  model set to ``_attn_implementation = CONTEXT_ATTENTION_NAME``. The model's attention modules call
  :func:`~.context_attention.context_attention_forward` with this rank's rotated ``q``/``k``/``v``
  (``[B, heads, T / cp, head_dim]``); it runs the path
  :func:`~lightning_d9d.modules.context_attention.context_attention` chose (all-gather K/V with the load-balanced
  global causal mask, or torch's ring kernels on CUDA), each attention module holding it. Attention sinks
  (``s_aux``: GPT-OSS's ``sinks``) run on the all-gather path as one more key. A sliding-window layer (the
  ``sliding_window`` ``transformers`` hands the attention: Mistral's and StarCoder2's every layer, Gemma2's and
  Gemma3's ``"sliding_attention"`` layers) adds the window's band to the mask on the all-gather path (torch's ring
  kernels hand such a layer to it under ``"auto"``); an attention logit soft cap (Gemma2's ``softcap``) runs on
  the all-gather path too, which then computes the scores itself. Under ``"heads"`` (head-parallel) the model's
  own attention function runs over the whole sequence for this rank's heads instead, windows, soft caps and sinks
  its own (:mod:`.head_parallel`); where cp does not divide the query heads, the all-gather path runs between the
  head exchanges (:mod:`~lightning_d9d.modules.hybrid_attention`).
- the causal mask: our name has no mask function in ``transformers``' mask interface, so the model builds no
  (local, wrong) causal mask and hands the attention ``None``; the attention applies the global causal mask itself.
- positions: a forward pre-hook on the base model (the decoder) gives it ``position_ids`` of this rank's chunks by
  global position when the caller passes none (RoPE, ``rotary_emb(x, position_ids)``, then rotates by the global position).

Packed rows: ``position_ids`` of the caller's (restarting at 0 per document; the strategy cuts them like the ids)
stay the RoPE positions, and the same pre-hook gathers them over cp once per forward into each rank's documents'
mask (``[B, 1, T / cp, T]``, 4-D, which ``transformers`` hands on unchanged; head-parallel: the whole
``[B, 1, T, T]``); the all-gather and head-parallel paths only (the ring kernels are refused, by name, before any
collective).

A 2-D ``attention_mask`` (``[B, T / cp]``, padding: 1 keep, 0 pad; the strategy cuts it like the inputs) is
all-gathered over cp by the same pre-hook into the whole sequence's key mask, handed on as ``[B, 1, 1, T]``
(``transformers`` passes a 4-D mask through unchanged) and combined with the causal mask; a padded query that
would see no key at all sees itself (its output reaches no unpadded token and no counted label). The all-gather
and head-parallel paths take it (torch's ring kernels know only the causal mask).

Labels must be shifted by the caller (``model_loss(..., loss_fn)`` with ``labels[:, t]`` the token after ``t``):
the model's own ``labels=`` loss shifts inside the local chunks, which under cp are not contiguous.

Nothing here imports ``transformers``: the interface is taken from the already loaded ``transformers.modeling_utils``.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.models.hf.context_attention import (
    ATTEND_ATTRIBUTE,
    CONTEXT_ATTENTION_NAME,
    register_context_attention,
)
from lightning_d9d.models.hf.head_parallel import keep_own_attention
from lightning_d9d.modules.attention import ContextAttentionFn, HeadParallelContext
from lightning_d9d.modules.context_attention import (
    LoadBalancedSplit,
    TorchRingAttention,
    context_attention,
    gather_positions,
)
from lightning_d9d.modules.documents import document_causal_mask, document_ids
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention
from lightning_d9d.modules.hybrid_attention import (
    head_group_size,
    hybrid_head_parallel,
)

log = logging.getLogger("lightning_d9d.models.hf")
#: The ``layer_types`` our context-parallel attention runs exactly.
_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_hf_context_model(model: nn.Module, cp: int) -> None:
    """Refuse, from the model's config alone (before any collective), what our context-parallel attention cannot
    run exactly: a model without a causal mask, layers that are neither full nor sliding-window attention
    (``layer_types`` of linear or chunked attention, say), attention dropout, a forward without
    ``position_ids``."""
    name, config = type(model).__name__, getattr(model, "config", None)
    prefix = f"{name}: cp={cp}"
    if config is None:
        raise NotImplementedError(f"{prefix} needs the model's config (a transformers PreTrainedModel)")
    if not getattr(config, "is_causal", True):
        raise NotImplementedError(
            f"{prefix}: its config ({type(config).__name__}) has is_causal=False; context parallelism "
            "implements causal attention only"
        )
    layer_types = getattr(config, "layer_types", None)
    other = sorted({t for t in (layer_types or ()) if t not in _LAYER_TYPES})
    if other:
        raise NotImplementedError(
            f"{prefix}: its config ({type(config).__name__}) has layer_types {other}; context parallelism "
            "implements full and sliding-window causal attention only (not yet the others); use cp=1"
        )
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise NotImplementedError(
            f"{prefix}: its config ({type(config).__name__}) has attention_dropout={dropout}; context-parallel "
            "attention has no dropout: set attention_dropout=0.0, or use cp=1"
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise NotImplementedError(
            f"{prefix}: {name}.forward takes no position_ids, so its positions cannot be the global ones"
        )


def parallelize_hf_context(
    model: nn.Module, cp_mesh: DeviceMesh, attention: str = "auto", *, tp: int = 1
) -> LoadBalancedSplit:
    """Context parallelism over the 1-D ``cp_mesh`` for a ``transformers`` model, in place (see the module's
    docstring); ``attention`` names the path (``"auto"``, ``"all_gather"``, ``"torch_ring"``, ``"heads"``: where cp
    does not divide a tp rank's query heads, ``num_attention_heads / tp``, the heads split over ``gcd`` of the two
    and the keys gathered over the rest). Returns the split."""
    if cp_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_hf_context needs the 1-D cp mesh, got {cp_mesh.ndim}-D {cp_mesh.mesh_dim_names}"
        )
    check_hf_context_model(model, cp_mesh.size())
    attentions = [module for module in model.modules() if _is_attention(module)]
    if not attentions:
        raise ValueError(
            f"parallelize_hf_context: found no attention module in {type(model).__name__} (a module with a "
            "config and is_causal, as transformers' attention classes have); use cp=1"
        )
    cp = cp_mesh.size()
    attention = _attention_path(model, attentions, cp, attention)
    split = LoadBalancedSplit(cp, cp_mesh.get_local_rank())
    attend: ContextAttentionFn | HeadParallelContext
    group = head_group_size(math.gcd(*(_query_heads(module) // tp for module in attentions)), cp)
    if attention == "heads" and group == cp:  # before the configs name our attention
        keep_own_attention(model, attentions)
        attend = context_attention(split, cp_mesh, attention)
    elif attention == "heads" and group > 1:
        attend = hybrid_head_parallel(split, cp_mesh, group)
    else:  # no two cp ranks can split the query heads: the all-gather path
        attend = context_attention(split, cp_mesh, "all_gather" if attention == "heads" else attention)
    for module in attentions:
        setattr(module, ATTEND_ATTRIBUTE, attend)
    register_context_attention()
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if _is_config(config):
            configs[id(config)] = config
    for config in configs.values():
        config._attn_implementation = CONTEXT_ATTENTION_NAME
    # On the base model (the decoder), which builds the positions and the mask: the causal LM's forward calls it,
    # and so does the fused head + loss (models/hf/loss.py), which runs the base model without the head.
    base = getattr(model, "base_model", None)
    base = base if isinstance(base, nn.Module) else model
    hook = _GlobalPositions(
        base,
        split,
        cp_mesh.get_group(),
        masks=not isinstance(attend, TorchRingAttention),
        whole=isinstance(attend, HeadParallelAttention),
    )
    base.register_forward_pre_hook(hook, with_kwargs=True)
    return split


def _attention_path(model: nn.Module, attentions: list[nn.Module], cp: int, attention: str) -> str:
    """The attention path for ``model``. Attention sinks (GPT-OSS's ``sinks``, one softmax logit per head, handed
    to the attention as ``s_aux``) and an attention logit soft cap (Gemma2's ``attn_logit_softcapping``) run on
    the all-gather path only (:mod:`.context_attention`): ``"auto"`` takes it for the whole model. A sliding
    window keeps ``"auto"``: torch's ring path hands each windowed layer to the all-gather path. ``"torch_ring"``
    by name is refused for all three (torch's ring kernels have no sink, no soft cap and no window)."""
    name = type(model).__name__
    with_sinks = [module for module in attentions if isinstance(getattr(module, "sinks", None), torch.Tensor)]
    capped = [module for module in attentions if getattr(module, "attn_logit_softcapping", None) is not None]
    windowed = [module for module in attentions if _attention_window(module) is not None]
    if attention == "torch_ring":
        if with_sinks:
            raise NotImplementedError(
                f"{name}: cp={cp}: its attention ({type(with_sinks[0]).__name__}) has sinks (a softmax logit per "
                "head), which torch's ring kernels do not take; use context_attention='all_gather' (or 'auto')"
            )
        if capped:
            raise NotImplementedError(
                f"{name}: cp={cp}: its attention ({type(capped[0]).__name__}) caps its logits "
                f"(attn_logit_softcapping={capped[0].attn_logit_softcapping}), which torch's ring kernels do not "
                "take; use context_attention='all_gather' (or 'auto')"
            )
        if windowed:
            raise NotImplementedError(
                f"{name}: cp={cp}: its attention ({type(windowed[0]).__name__}) attends within a sliding window "
                f"of {_attention_window(windowed[0])}, which torch's ring kernels do not take; use "
                "context_attention='auto' (the all-gather path for the windowed layers) or 'all_gather'"
            )
    if attention != "auto" or not (with_sinks or capped):
        return attention
    owner = type((with_sinks or capped)[0]).__name__
    why = "attention sinks" if with_sinks else "attention logit soft cap"
    log.info("context-parallel attention: all_gather for %s's %s, cp=%d", owner, why, cp)
    return "all_gather"


def _query_heads(module: nn.Module) -> int:
    """The model's query heads (``num_attention_heads`` of the module's config), of which a tp rank holds
    ``1 / tp``."""
    config: Any = module.config
    return int(config.num_attention_heads)


def _attention_window(module: nn.Module) -> int | None:
    """The sliding window ``transformers`` hands ``module``'s attention: its own ``sliding_window`` where it has
    one (Gemma2/3, GPT-OSS, Qwen2/3: set on ``"sliding_attention"`` layers only), else its config's where the
    config has no ``layer_types`` (Mistral, StarCoder2: every layer)."""
    if hasattr(module, "sliding_window"):
        return getattr(module, "sliding_window", None)
    config = getattr(module, "config", None)
    if getattr(config, "layer_types", None):
        return None
    return getattr(config, "sliding_window", None)


class _GlobalPositions:
    """The model's forward pre-hook: ``position_ids`` of this rank's chunks (global positions) when the caller
    passes none, and a 2-D padding ``attention_mask`` gathered over cp into the whole sequence's key mask.

    ``position_ids`` of the caller's (packed rows: restarting at 0 per document, cut by the strategy like the
    ids) stay this rank's RoPE positions and give the attention the documents' mask (:meth:`document_mask`).

    ``masks``: the attention takes a padding or documents' mask (torch's ring kernels do not); ``whole``: its
    queries are the whole sequence's (head-parallel), not this rank's."""

    def __init__(
        self,
        model: nn.Module,
        split: LoadBalancedSplit,
        group: dist.ProcessGroup,
        *,
        masks: bool,
        whole: bool = False,
    ) -> None:
        self.split = split
        self.group = group
        self.masks = masks
        self.whole = whole
        names = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.index = {name: i for i, name in enumerate(names)}

    def _get(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        i = self.index.get(name)
        if i is not None and i < len(args):
            return args[i]
        return kwargs.get(name)

    def _set(
        self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        i = self.index.get(name)
        if i is not None and i < len(args):
            return (*args[:i], value, *args[i + 1 :]), kwargs
        return args, {**kwargs, name: value}

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = self._get("input_ids", args, kwargs)
        if tokens is None:
            tokens = self._get("inputs_embeds", args, kwargs)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError(
                f"{type(module).__name__} under cp: pass input_ids ([batch, sequence / cp]) or inputs_embeds"
            )
        given = self._get("position_ids", args, kwargs)
        mask = self._get("attention_mask", args, kwargs)
        if given is None:
            positions = self.split.local_positions(tokens.shape[1], device=tokens.device).unsqueeze(0)
            args, kwargs = self._set("position_ids", positions, args, kwargs)
        elif mask is not None:
            raise NotImplementedError(
                f"{type(module).__name__} under cp={self.split.cp}: position_ids together with an attention_mask; "
                "pass one: position_ids restarting per document (packed rows), or a 2-D padding mask"
            )
        elif not self.masks:  # before any collective: every cp rank refuses alike
            raise NotImplementedError(
                f"{type(module).__name__} under cp={self.split.cp}: position_ids of the caller's (packed rows) with "
                "torch's ring kernels, which know only the causal mask; use "
                "D9DStrategy(context_attention='all_gather'), or pass no position_ids"
            )
        else:  # one gather per forward; every layer's attention takes the same mask
            args, kwargs = self._set(
                "attention_mask", self.document_mask(given, tokens.shape[0]), args, kwargs
            )
            return args, kwargs
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            args, kwargs = self._set("attention_mask", self.gather_keys(mask), args, kwargs)
        return args, kwargs

    def document_mask(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """``[B, 1, T / cp, T]``: this rank's queries' rows of the one-process document mask (our models' mask,
        :func:`~lightning_d9d.modules.documents.document_causal_mask`), from every rank's positions gathered once
        per forward; ``[B, 1, T, T]``, the whole mask, for head-parallel attention."""
        local = positions.to(torch.int64).expand(batch, -1)  # [B, T / cp]
        rows = gather_positions(local, self.split, self.group)
        if self.whole:
            return document_causal_mask(document_ids(rows))
        queries = self.split.local_positions(local.shape[1], device=rows.device)
        return document_causal_mask(document_ids(rows), queries)

    def gather_keys(self, mask: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, T / cp]`` padding mask -> the whole sequence's ``[B, 1, 1, T]`` (bool, in order)."""
        whole = gather_positions(mask.to(torch.int64), self.split, self.group)
        return whole.to(torch.bool)[:, None, None, :]


def _is_config(value: object) -> bool:
    return value is not None and hasattr(type(value), "_attn_implementation")


def _is_attention(module: nn.Module) -> bool:
    """A ``transformers`` attention module: it holds the config and calls the attention interface
    (``is_causal``, ``head_dim`` / ``num_key_value_groups``, as every decoder family's attention class)."""
    return (
        _is_config(getattr(module, "config", None))
        and hasattr(module, "is_causal")
        and (hasattr(module, "num_key_value_groups") or hasattr(module, "head_dim"))
    )
