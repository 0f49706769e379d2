"""The trait a model implements to be split into pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class PipelineSplittable(Protocol):
    """A model made of an input part, ``num_pipeline_layers`` repeated layers and an output part.

    The strategy calls ``pipeline_keep`` once with every layer this rank holds (the model drops the rest
    in place, so parameter names stay global and checkpoints do not depend on the split), then
    ``pipeline_stage`` once per local stage for the module that the schedule runs. A stage's forward takes
    the input ids when ``first`` (hidden states otherwise) and returns logits when ``last``; given
    ``labels=`` and ``ignore_index=`` keyword arguments (the strategy passes them when it fuses the LM head with
    the loss) the last stage returns the mean loss over the labels instead, and the others ignore them.
    """

    @property
    def num_pipeline_layers(self) -> int: ...

    def pipeline_keep(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> None: ...

    def pipeline_stage(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module: ...
