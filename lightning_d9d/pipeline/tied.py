"""Tied weights whose modules sit on different pipeline ranks: an input embedding on the first stage tied to the
LM head on the last (``tie_word_embeddings=True``, the default of Gemma, Cohere, SmolLM3, StarCoder2 and the
smaller Qwen3).

Once the stages are carved, each of those ranks holds its own copy of the one parameter. They train as one, as
Megatron-LM keeps its embedding group: before the first step every copy takes the value of the first name's
holder (initialisation by name, or an HF folder that stores only the embedding, may have given the head another),
and after each backward that reduces gradients the copies' gradients are summed over the pipeline group, so that
each copy holds the whole gradient the one parameter would have and every optimizer step moves them alike. The
gradient norm counts the parameter once: the copies other than the first are marked (:func:`is_tied_copy`) and
left out of it, though clipping scales them too.

Ranks of the pipeline group that hold no copy (the middle stages when pp > 2) join each collective with zeros of
the copy's local shape (every copy is sharded alike: same shape, same FSDP and tp placements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.mesh.arrival import named_collective

_TIED_COPY = "_d9d_tied_copy"


def is_tied_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` is a second copy of a weight tied across pipeline ranks (its norm counted elsewhere)."""
    return bool(getattr(param, _TIED_COPY, False))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _TiedWeight:
    names: tuple[str, ...]
    param: nn.Parameter | None  # this rank's copy, if it holds one
    source: int  # the pp rank whose copy the others take before the first step
    shape: torch.Size  # the local shape of every copy
    dtype: torch.dtype
    trained: bool  # requires_grad (the copies are frozen alike, or trained alike)


class TiedAcrossStages:
    """The tied weights of ``model`` (its ``tied`` name pairs, found before the stages were carved) whose copies
    ended up on more than one rank of ``group`` (the pipeline group)."""

    def __init__(
        self,
        model: nn.Module,
        tied: Sequence[tuple[str, str]],
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.group = group
        self.device = device
        self.weights: list[_TiedWeight] = []
        if not tied:
            return
        named = dict(model.named_parameters(remove_duplicate=False))
        held = {
            name: (tuple(_local(named[name]).shape), _local(named[name]).dtype, named[name].requires_grad)
            for pair in tied
            for name in pair
            if name in named
        }
        everyone: list[dict[str, tuple[tuple[int, ...], torch.dtype, bool]]] = [{}] * dist.get_world_size(
            group
        )
        with named_collective("the tied weights' holders (all_gather_object)", group):
            dist.all_gather_object(everyone, held, group=group)
        for pair in tied:
            holders = [rank for rank, names in enumerate(everyone) if set(pair) & set(names)]
            if len(holders) < 2:
                continue  # one rank holds every name: one parameter, nothing to keep in step
            source = next(rank for rank, names in enumerate(everyone) if pair[0] in names)
            shape, dtype, trained = everyone[source][pair[0]]
            mine = [named[name] for name in pair if name in named]
            param = mine[0] if mine else None
            if param is not None and dist.get_rank(group) != source:
                setattr(param, _TIED_COPY, True)
            self.weights.append(_TiedWeight(pair, param, source, torch.Size(shape), dtype, trained))

    def _buffer(self, weight: _TiedWeight, tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is not None:
            return _local(tensor)
        return torch.zeros(weight.shape, dtype=weight.dtype, device=self.device)

    @torch.no_grad()
    def sync_values(self) -> None:
        """Every copy takes its source's value (the runner calls it when the stages are built, and once more
        before the first step: weights may be loaded in between, from a checkpoint or from an HF folder that
        stores only the embedding; later the copies move alike)."""
        for weight in self.weights:
            local = self._buffer(weight, weight.param)
            dist.broadcast(local, src=dist.get_global_rank(self.group, weight.source), group=self.group)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum over the copies: the one parameter's whole gradient."""
        for weight in self.weights:
            if not weight.trained:
                continue
            param = weight.param
            if param is not None and param.grad is None:
                param.grad = torch.zeros_like(param)  # this copy's stage used none of it in this step
            dist.all_reduce(self._buffer(weight, None if param is None else param.grad), group=self.group)
