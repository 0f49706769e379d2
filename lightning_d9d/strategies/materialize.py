"""Giving meta tensors their memory (torchmetrics metrics untouched), and initialising transformers models."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchmetrics import Metric

from lightning_d9d.modules.hf_init import init_transformers_model_, is_transformers_model


def to_empty_except_metrics(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` for every submodule except torchmetrics metrics.

    A ``Metric`` applies ``to_empty`` to its states and to their defaults as well (its ``_apply``), which leaves
    them uninitialised memory: a metric built in the LightningModule's ``__init__`` then accumulates onto
    garbage and ``reset()`` restores garbage (a perplexity read back as ``inf``). Metrics hold no meta tensors,
    so they have nothing to gain from it.

    A tensor shared by several modules (a tied embedding and LM head) stays one tensor: ``to_empty`` would give
    each module its own (plain parameters; an FSDP ``DTensor`` keeps its identity).
    """
    _to_empty(module, device, {})


def _to_empty(
    module: nn.Module, device: torch.device, done: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    if isinstance(module, Metric):
        return
    stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    before = [(store, key, tensor) for store in stores for key, tensor in store.items() if tensor is not None]
    module.to_empty(device=device, recurse=False)
    for store, key, tensor in before:
        if id(tensor) in done:  # one already materialised through another module
            store[key] = done[id(tensor)][1]
        else:
            done[id(tensor)] = (tensor, store[key])  # the meta tensor held too, so that its id stays its own
    for child in module.children():
        _to_empty(child, device, done)


def initialise_transformers_model(module: nn.Module, seed: int) -> bool:
    """If ``module`` is a transformers ``PreTrainedModel``: initialise it by its own ``_init_weights`` rules, alike
    on every sharding (:func:`~lightning_d9d.modules.hf_init.init_transformers_model_`), and return True.

    Its ``init_weights()`` looks like :class:`~lightning_d9d.plans.SeededInit`'s but takes no seed, and draws
    each ``DTensor`` shard on its own.
    """
    if not is_transformers_model(module):
        return False
    missed = init_transformers_model_(module, seed)
    if missed:
        rank_zero_warn(
            f"{type(module).__name__}: no _init_weights rule or reset_parameters() wrote these meta-device "
            f"tensors, left NaN: {', '.join(missed[:10])}{' ...' if len(missed) > 10 else ''}"
        )
    return True
