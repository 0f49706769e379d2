"""The fused-head choice: whether a forward's loss runs through the model's LM head fused with its cross-entropy
(no ``[tokens, vocab]`` logits, :func:`~lightning_d9d.kernels.linear_cross_entropy`) or through the logits.

The head runs fused where every condition holds:

- the loss is a plain :class:`~lightning_d9d.modules.loss.CausalLMLoss` (its ``ignore_index`` goes to the kernel);
- the model declares its head (:class:`~lightning_d9d.modules.head.FusedHead`: our causal LMs themselves, a
  ``transformers`` causal LM through the adapter, :data:`HEAD_VIEWS`) and the head binds the inputs;
- fusion is on: the model's ``fuse_head_loss`` if set (a ``transformers`` model may be given one too), else
  ``$LIGHTNING_D9D_FUSED_LOSS=1`` / ``0``, else on CUDA, where the logits' memory matters (on CPU the logits path
  keeps results bitwise equal to a plain loop);
- no tensor parallelism: under tp the logits stay vocabulary-sharded and torch's loss parallel computes the
  cross-entropy on the shards (logged once).

Under pp the last stage of a model whose stages take the labels computes the same loss (:func:`fused_ignore_index`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from lightning_d9d.models.hf.loss import transformers_head
from lightning_d9d.modules.head import FusedHead
from lightning_d9d.modules.inputs import ModelInputs
from lightning_d9d.modules.loss import CausalLMLoss

FUSED_LOSS_ENV = "LIGHTNING_D9D_FUSED_LOSS"
log = logging.getLogger("lightning_d9d.loss")
_ANNOUNCED: set[str] = set()

# Who declares the head of a model that is no FusedHead itself: the transformers adapter.
HEAD_VIEWS: tuple[Callable[[nn.Module], FusedHead | None], ...] = (transformers_head,)


def declared_head(model: nn.Module) -> FusedHead | None:
    """The head ``model`` declares: itself if it is a :class:`FusedHead`, else what :data:`HEAD_VIEWS` see in it;
    None for any other module."""
    if isinstance(model, FusedHead):
        return model
    for view in HEAD_VIEWS:
        head = view(model)
        if head is not None:
            return head
    return None


def fused_ignore_index(model: nn.Module, loss_fn: object, *, tensor_parallel: bool = False) -> int | None:
    """Under pp: the ``ignore_index`` with which the last stage of ``model`` (the pipelined model) computes
    ``loss_fn`` itself, handed the labels; None where the schedule's loss runs on logits (a model whose stages
    take no labels: a ``transformers`` model's). A rank without the head decides alike."""
    head = declared_head(model)
    if head is None or not head.stages_take_labels:
        return None
    return _fused_ignore_index(model, loss_fn, tensor_parallel)


def fused_causal_lm_loss(
    model: nn.Module,
    inputs: ModelInputs,
    labels: torch.Tensor,
    loss_fn: object,
    *,
    tensor_parallel: bool = False,
) -> torch.Tensor | None:
    """``loss_fn(model(*inputs), labels)`` (``model(**inputs)`` for a dict) computed by the model's head without
    logits where every condition of the module docstring holds; None where the caller must run the logits path."""
    run = _fused_loss(model, inputs, loss_fn, tensor_parallel)
    return None if run is None else run(labels)


def fuses_head(
    model: nn.Module,
    inputs: ModelInputs,
    loss_fn: object,
    *,
    tensor_parallel: bool = False,
    pipelined: bool = False,
) -> bool:
    """Whether the loss runs with the head fused, asked before it runs (the memory plan counts the head by it):
    the last stage's choice under pp (:func:`fused_ignore_index`), :func:`fused_causal_lm_loss`'s without. The same
    decision, runs nothing: it only logs the choice once, as the loss itself would."""
    if pipelined:
        return fused_ignore_index(model, loss_fn, tensor_parallel=tensor_parallel) is not None
    return _fused_loss(model, inputs, loss_fn, tensor_parallel) is not None


def _fused_loss(
    model: nn.Module, inputs: ModelInputs, loss_fn: object, tensor_parallel: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fused loss as a function of the labels where every condition holds, else None: one decision for the
    loss and for :func:`fuses_head`."""
    if type(loss_fn) is not CausalLMLoss:
        return None
    head = declared_head(model)
    bound = None if head is None else head.bind_head_loss(inputs)
    if bound is None:
        return None
    ignore_index = _fused_ignore_index(model, loss_fn, tensor_parallel)
    if ignore_index is None:
        return None
    return lambda labels: bound(labels, ignore_index)


def _fused_ignore_index(model: nn.Module, loss_fn: object, tensor_parallel: bool) -> int | None:
    if type(loss_fn) is not CausalLMLoss:
        return None
    if not _fusing(model, next(model.parameters()).device):  # under pp, a rank without the head decides alike
        return None
    if tensor_parallel:
        _announce(
            "tp", "fused LM head + cross-entropy off under tp > 1: the logits path with loss parallel runs"
        )
        return None
    _announce("fused", "LM head + cross-entropy fused (no [tokens, vocab] logits)")
    return loss_fn.ignore_index


def _fusing(model: nn.Module, device: torch.device) -> bool:
    chosen = getattr(model, "fuse_head_loss", None)
    if chosen is not None:
        return bool(chosen)
    setting = os.environ.get(FUSED_LOSS_ENV)
    if setting not in (None, "", "0", "1"):
        raise ValueError(
            f"${FUSED_LOSS_ENV}={setting!r}: set 1 (fuse), 0 (logits path) or leave it unset (CUDA only)"
        )
    if setting:
        return setting == "1"
    return device.type == "cuda"


def _announce(key: str, message: str) -> None:
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        log.info(message)
