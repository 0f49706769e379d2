"""The inputs ``model_loss`` hands a model: a tuple (``model(*inputs)``) or a dict (``model(**inputs)``).

A tuple binds by position, which is exact for our models (``forward(input_ids, position_ids=None)``) but not for a
``transformers`` causal LM, whose forward reads ``(input_ids, attention_mask, position_ids, ...)``: packed rows
passed as ``(input_ids, position_ids)`` would reach it as an attention mask, and the positions (the document
boundaries) would be lost without an error. A dict says which tensor is which, for every model:
``{"input_ids": ids, "position_ids": positions}``. :func:`call_model` refuses more than one positional input for a
``transformers`` model, naming the dict to pass instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
from torch import nn

from lightning_d9d.modules.hf_init import is_transformers_model

#: ``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict (keyword arguments of the model's forward).
ModelInputs: TypeAlias = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]


def call_model(model: nn.Module, inputs: ModelInputs) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple (refused for a ``transformers`` model with
    more than one input: :func:`check_inputs`)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    check_inputs(model, inputs)
    return model(*inputs)


def check_inputs(model: nn.Module, inputs: ModelInputs) -> None:
    """Refuse positional inputs beyond the first for a ``transformers`` model (see the module docstring)."""
    module = getattr(model, "_forward_module", model)  # a Fabric-wrapped model: the user's module
    if isinstance(inputs, Mapping) or len(inputs) <= 1 or not is_transformers_model(module):
        return
    name = type(module).__name__
    raise ValueError(
        f"model_loss got {len(inputs)} positional inputs for {name}, a transformers model whose forward reads "
        "them in its own order (input_ids, attention_mask, position_ids, ...): packed rows passed as "
        "(input_ids, position_ids) would be read as an attention mask. Pass a dict of keyword arguments "
        "instead: model_loss(module, model, {'input_ids': ids, 'position_ids': positions}, labels, loss_fn)"
    )
