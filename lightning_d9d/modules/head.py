"""What a causal LM tells the loss layer about its LM head: that it can compute the head's cross-entropy from the
final hidden states without the ``[tokens, vocab]`` logits (:func:`~lightning_d9d.kernels.linear_cross_entropy`).

A model declares what it can (:class:`FusedHead`); the loss layer decides when it runs (the loss function, the
model's ``fuse_head_loss``, ``$LIGHTNING_D9D_FUSED_LOSS``, the device, tensor parallelism: see
:mod:`lightning_d9d.loss.head`) and weighs what it returns. A model never calls back into that choice or into the
weighting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, runtime_checkable

import torch

from lightning_d9d.modules.inputs import ModelInputs

#: ``(labels, ignore_index) -> the mean cross-entropy`` over the labels that are not ``ignore_index``.
HeadLoss: TypeAlias = Callable[[torch.Tensor, int], torch.Tensor]


@runtime_checkable
class FusedHead(Protocol):
    """A causal LM whose head's loss can run without logits: our
    :class:`~lightning_d9d.models.causal_lm.CausalLM`, or a ``transformers`` causal LM through the adapter's
    :class:`~lightning_d9d.models.hf.loss.TransformersHead`."""

    #: Whether the model's own pipeline stages take ``labels=`` / ``ignore_index=`` keyword arguments, the last
    #: stage then returning the mean loss of its microbatch instead of logits.
    stages_take_labels: bool

    def bind_head_loss(self, inputs: ModelInputs) -> HeadLoss | None:
        """The loss of ``model(*inputs)``'s logits (``model(**inputs)`` for a dict) as a function of the labels,
        computed without the logits; None where these inputs or this rank cannot (the head held by another
        pipeline rank, inputs the fused forward does not take). Binding runs nothing."""
        ...
