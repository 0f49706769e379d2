"""``model_loss``: the one call a ``training_step`` makes so that it runs with and without pipelining."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import lightning as L
import torch
from torch import nn

from lightning_d9d.compat import trainer_of
from lightning_d9d.modules.inputs import ModelInputs, call_model
from lightning_d9d.pipeline.runner import LossFn
from lightning_d9d.strategies.d9d import D9DStrategy


@runtime_checkable
class ComputesModelLoss(Protocol):
    """A strategy that computes a forward's loss on its mesh itself (the d9d strategies)."""

    def model_loss(
        self, model: nn.Module, inputs: ModelInputs, target: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor: ...


def model_loss(
    module: L.LightningModule | L.Fabric,
    model: nn.Module,
    inputs: ModelInputs,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``loss_fn(model(*inputs), target)``, or, under ``D9DStrategy(pp>1)``, the same loss computed through the
    pipeline schedule (microbatched, with backward done; see :meth:`D9DStrategy.model_loss`).

    ``loss_fn`` returns the mean loss of the (micro)batch it is given. If it is a
    :class:`~lightning_d9d.modules.loss.CountedLoss` (``causal_lm_loss`` is), the d9d strategy weighs microbatches
    and data-parallel ranks by their counted items (tokens), so padding does not skew the mean; otherwise they
    weigh the same. Works with any strategy, and outside a Trainer (then it is just ``loss_fn(model(*inputs),
    target)``).

    ``inputs`` is a tuple (``model(*inputs)``) or a dict of keyword arguments (``model(**inputs)``). A
    ``transformers`` model takes more than its token ids only as a dict (``{"input_ids": ids, "position_ids":
    positions}`` for packed rows): its forward's second parameter is ``attention_mask``, so a longer tuple is
    refused (:func:`~lightning_d9d.modules.inputs.call_model`).

    In a Fabric loop pass the ``Fabric`` as ``module``: under ``Fabric(strategy="d9d")`` the loss is computed as
    the Trainer's (cp split, token-weighted ranks, vocabulary-parallel or fused cross-entropy), see
    :meth:`~lightning_d9d.fabric.D9DFabricStrategy.model_loss`.
    """
    if isinstance(module, L.Fabric):
        if isinstance(module.strategy, ComputesModelLoss):  # D9DFabricStrategy (a layer above this one)
            return module.strategy.model_loss(model, inputs, target, loss_fn)
        return loss_fn(call_model(model, inputs), target)
    trainer = trainer_of(module)
    if trainer is not None and isinstance(trainer.strategy, D9DStrategy):
        return trainer.strategy.model_loss(model, inputs, target, loss_fn)
    return loss_fn(call_model(model, inputs), target)
