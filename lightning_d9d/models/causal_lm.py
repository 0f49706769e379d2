"""What every decoder-only causal LM of ours shares, whatever its blocks: the tied LM head and the pipeline cut.

A model keeps ``self.model`` (with ``embed_tokens``, a ``layers`` ModuleDict keyed by layer number, ``norm``),
``self.lm_head`` and ``self.config.tie_word_embeddings``; its own file holds its config, blocks and plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Self


class CausalLM(nn.Module):
    """Base of the causal LMs: ties the head to the embedding and drops what a pipeline rank does not hold."""

    config: Any
    model: Any  # the decoder: embed_tokens, layers (ModuleDict), norm
    lm_head: nn.Linear | None

    def _tie_weights(self) -> None:
        head, embedding = self.lm_head, self.model.embed_tokens
        tied = self.config.tie_word_embeddings and head is not None and embedding is not None
        if tied and head.weight is not embedding.weight:  # type: ignore[union-attr]
            head.weight = embedding.weight  # type: ignore[union-attr]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # ``to_empty`` from meta (and any conversion that cannot reuse the tensor in place) registers a new
        # Parameter per module, which would silently untie the head from the embedding. DTensor parameters
        # (after fully_shard) are swapped in place and stay tied; then this is a no-op.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    # ------------------------------------------------------------------------------------------ pipeline
    @property
    def num_pipeline_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def pipeline_keep(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        """Drop, in place, every layer but ``layer_ids``, and the embedding / norm and head unless this rank
        holds the first / last stage (see :class:`~lightning_d9d.pipeline.PipelineSplittable`)."""
        if self.config.tie_word_embeddings and not (first and last):
            raise ValueError(
                f"{type(self).__name__}: tie_word_embeddings=True cannot be split over pipeline stages on "
                "different ranks (the embedding and the head would be two copies); set tie_word_embeddings=False "
                "or pp=1"
            )
        keep = {str(i) for i in layer_ids}
        for key in [key for key in self.model.layers if key not in keep]:
            del self.model.layers[key]
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
            self.lm_head = None
