"""The input embedding of a ``transformers`` model under tensor parallelism: split over the vocabulary, its
forward repeated on the reduced rows.

:class:`VocabParallelWholeEmbedding` splits the rows (the vocabulary) over tp and hands every rank the whole
sequence's embeddings (an all-reduce of the rows' partial sums), so the decoder builds its mask and positions as
in one process. An embedding whose forward scales the lookup by an attribute of its own (Gemma's
``embed_scale``) scales the reduced rows alike: :func:`embedding_scale` reads that from the forward's syntax tree;
any other forward of its own is refused by :func:`~.tensor.check_tensor_parallel_model`.
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_d9d.models.hf.loss import forward_tree
from lightning_d9d.plans.tensor import vocab_parallel_lookup


class EmbeddingScale(NamedTuple):
    """An embedding's forward ``super().forward(ids) * self.<attribute>``, the scale cast to the weight's dtype
    first where ``cast`` (Gemma's ``* self.embed_scale.to(self.weight.dtype)``)."""

    attribute: str
    cast: bool

    def apply(self, embedding: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        scale = getattr(embedding, self.attribute)
        return rows * (scale.to(embedding.weight.dtype) if self.cast else scale)


# A plain nn.Embedding's forward: the lookup and nothing else.
NO_SCALE = EmbeddingScale("", cast=False)


def embedding_scale(embedding: nn.Embedding) -> EmbeddingScale | None:
    """What ``embedding``'s forward does after the lookup: :data:`NO_SCALE` for ``nn.Embedding``'s own forward, an
    :class:`EmbeddingScale` for a forward ``return super().forward(ids) * self.<scale>`` (optionally
    ``.to(self.weight.dtype)``; a tensor or a number there), read from its syntax tree; ``None`` for any other."""
    if type(embedding).forward is nn.Embedding.forward:
        return NO_SCALE
    embedding_class: Any = type(embedding)  # cached per class
    function = forward_tree(embedding_class)
    if function is None:
        return None
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    arguments = [argument.arg for argument in function.args.args]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or len(arguments) != 2:
        return None
    value = body[0].value
    if not (
        isinstance(value, ast.BinOp)
        and isinstance(value.op, ast.Mult)
        and _is_lookup(value.left, arguments[1])
    ):
        return None
    scale, cast = value.right, False
    if (  # <scale>.to(self.weight.dtype)
        isinstance(scale, ast.Call)
        and isinstance(scale.func, ast.Attribute)
        and scale.func.attr == "to"
        and len(scale.args) == 1
        and not scale.keywords
        and ast.unparse(scale.args[0]) == "self.weight.dtype"
    ):
        scale, cast = scale.func.value, True
    if not (
        isinstance(scale, ast.Attribute) and isinstance(scale.value, ast.Name) and scale.value.id == "self"
    ):
        return None
    found = getattr(embedding, scale.attr, None)
    if not isinstance(found, torch.Tensor | int | float) or isinstance(found, bool):
        return None
    if cast and not isinstance(found, torch.Tensor):
        return None
    return EmbeddingScale(scale.attr, cast)


def _is_lookup(node: ast.expr, ids: str) -> bool:
    """``super().forward(<ids>)``."""
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "super().forward"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == ids
    )


class VocabParallelWholeEmbedding(ParallelStyle):
    """Embedding rows (the vocabulary) split over tp, token ids whole, the output whole on every tp rank (an
    all-reduce of the rows' partial sums): the decoder builds its mask and positions from it. An embedding whose
    forward scales the lookup (:func:`embedding_scale`: Gemma's ``embed_scale``) scales the reduced rows alike, as
    one process does.

    Like :class:`~lightning_d9d.plans.VocabParallelEmbedding` the lookup runs on the local rows, so backward
    makes only this rank's ``[vocab / tp, hidden]`` gradient. The weight is a ``Shard(0)`` DTensor, as a
    column-parallel head's: a tied head stays tied.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(
                f"VocabParallelWholeEmbedding applies to nn.Embedding, not {type(module).__name__}"
            )
        scale = embedding_scale(module)
        if scale is None:  # refused by check_tensor_parallel_model
            raise NotImplementedError(f"{type(module).__name__}: a forward of its own")
        weight = distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)])
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        lookup = _whole_lookup if scale is NO_SCALE else functools.partial(_scaled_whole_lookup, scale=scale)
        module.forward = types.MethodType(lookup, module)  # type: ignore[method-assign]
        return module


def _whole_lookup(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_lookup(self.weight, ids, Replicate(), self.padding_idx)


def _scaled_whole_lookup(self: nn.Embedding, ids: torch.Tensor, *, scale: EmbeddingScale) -> torch.Tensor:
    return scale.apply(self, _whole_lookup(self, ids))
