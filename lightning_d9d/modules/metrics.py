"""Language-model metrics as ``torchmetrics`` metrics: perplexity and token accuracy over every counted token.

Why not torchmetrics' own: ``torchmetrics.text.Perplexity`` takes ``[B, T, V]`` logits and runs its own fp32
softmax over them (another ``[tokens, vocab]`` tensor: ~10 GB for 16k tokens at vocabulary 151k), repeating
what the loss already computed, and it cannot be fed where the logits never reach the training step (under
pipeline parallelism they stay inside the schedule). :class:`CausalLMPerplexity` is fed the loss instead: a sum
of token cross-entropies and the number of tokens it covers. ``MulticlassAccuracy(average="micro")`` needs
``num_classes`` and, by default, validates its inputs with host synchronisations on every update;
:class:`TokenAccuracy` needs neither.

Both keep sums (fp64 / int64) as their states, reduced by summing, so the value over many batches and ranks is
the ratio of totals (the token mean over all of them), not a mean of per-batch means. Updates stay on the
device: nothing is read back to the host before ``compute``. Under the d9d strategy a metric without a
``process_group`` of its own syncs over the data-parallel ranks only (pipeline peers hold the same batch).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class CausalLMPerplexity(Metric):
    """``exp(sum of token cross-entropies / number of tokens)`` over everything passed to :meth:`update`.

    Feed it what the loss already has, e.g. with ``causal_lm_loss`` (a mean over counted tokens)::

        tokens = causal_lm_loss.count(labels)
        perplexity.update(causal_lm_loss(logits, labels) * tokens, tokens)

    or per-token losses (``F.cross_entropy(..., reduction="none")`` gives 0 at ``ignore_index``) and their
    count. Padding must already be left out of both.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    loss_sum: Tensor
    tokens: Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.add_state("loss_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, tokens: Tensor | int | float) -> None:
        """``loss_sum``: the summed cross-entropy (nats) of ``tokens`` tokens; a tensor of any shape is summed."""
        self.loss_sum += loss_sum.detach().sum().to(torch.float64)
        self.tokens += torch.as_tensor(tokens).to(self.tokens)

    def compute(self) -> Tensor:
        """The perplexity; NaN before any token was counted (``0 / 0``)."""
        return torch.exp(self.loss_sum / self.tokens).float()


class TokenAccuracy(Metric):
    """The fraction of tokens whose most likely prediction is the label, over tokens whose label is not
    ``ignore_index``.

    ``update(logits, labels)`` with logits ``[..., V]`` and labels ``[...]``, or ``update(predictions, labels)``
    with predicted token ids of the labels' shape. Under tensor parallelism pass full (not vocabulary-sharded)
    logits or the predicted ids.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    correct: Tensor
    total: Tensor

    def __init__(self, ignore_index: int = -100, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, predictions: Tensor, labels: Tensor) -> None:
        if predictions.dim() == labels.dim() + 1:
            predictions = predictions.argmax(dim=-1)  # logits -> token ids
        if predictions.shape != labels.shape:
            raise ValueError(
                f"TokenAccuracy: predictions {tuple(predictions.shape)} must be logits [..., V] or token ids "
                f"of the labels' shape {tuple(labels.shape)}"
            )
        counted = labels != self.ignore_index
        self.correct += ((predictions == labels) & counted).sum()
        self.total += counted.sum()

    def compute(self) -> Tensor:
        """The accuracy in [0, 1]; NaN before any token was counted."""
        return (self.correct.double() / self.total).float()
