"""Tensor parallelism with sequence parallelism and loss parallelism, on torch's ``parallelize_module``.

The layout between blocks (the residual stream) is *sequence-sharded*: each tp rank holds ``T / tp`` positions
of every sequence as a plain tensor. A block gathers the sequence once before its column-parallel projections
(attention heads / MLP columns split over tp) and reduce-scatters it back after its row-parallel output
projection; the norms in between run on the sequence shard (their weights replicated, their gradients summed
over tp). The embedding is vocabulary-parallel and hands the residual stream out sequence-sharded; the LM head
is column-parallel over the vocabulary and leaves its logits sharded on the vocabulary dim, for
:func:`loss_parallel`'s cross-entropy, so no rank ever holds the ``[tokens, vocab]`` logits whole.

The style builders below name the layouts once; a model's plan maps its module names onto them.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_d9d.plans.fp8 import float8_tensor_plan
from lightning_d9d.plans.lora import lora_tensor_plan

# The sequence dim of ``[B, T, hidden]`` activations, and the heads dim of ``[B, T, heads, head_dim]``.
SEQUENCE_DIM = 1
HEADS_DIM = 2


def check_tensor_parallel_sizes(tp: int, owner: str, sizes: Mapping[str, int]) -> None:
    """Raise ``ValueError`` naming the first of ``sizes`` (name -> size) that ``tp`` does not divide.

    Called by a model's plan before any collective, where its config is known.
    """
    for name, size in sizes.items():
        if size % tp != 0:
            raise ValueError(
                f"{owner}: tp ({tp}) must divide {name} ({size}); choose a tp among the divisors of {size} "
                f"that also divide the other sizes ({', '.join(f'{k}={v}' for k, v in sizes.items())})"
            )


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Sequence parallelism cuts every sequence into ``tp`` equal parts."""
    if seq_len % tp != 0:
        raise ValueError(
            f"sequence parallelism needs a sequence length divisible by tp: {seq_len} % {tp} = {seq_len % tp}; "
            f"pad or cut the sequences to a multiple of {tp}"
        )


# ------------------------------------------------------------------------------------------------- styles
class VocabParallelEmbedding(ParallelStyle):
    """Embedding rows (the vocabulary) split over tp; token ids come in whole, the output leaves
    sequence-sharded (a reduce-scatter of the rows' partial sums instead of an all-reduce).

    Like torch's ``RowwiseParallel`` on an ``nn.Embedding`` (the weight a ``Shard(0)`` DTensor), but the lookup
    runs on the local rows: ids outside them read row 0 and are zeroed. Its backward then makes only this
    rank's ``[vocab / tp, hidden]`` gradient; torch's DTensor embedding backward builds the whole
    ``[vocab, hidden]`` gradient on every rank first (0.6 GB in fp32 at Qwen3's 151,936 x 1,024).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, not {type(module).__name__}")
        if module.num_embeddings % device_mesh.size() != 0:
            raise ValueError(
                f"VocabParallelEmbedding: tp ({device_mesh.size()}) must divide the vocabulary "
                f"({module.num_embeddings})"
            )
        weight = distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)])
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        module.forward = types.MethodType(_vocab_parallel_lookup, module)  # type: ignore[method-assign]
        return module


def vocab_parallel_lookup(
    weight: torch.Tensor, ids: torch.Tensor, output: Placement, padding_idx: int | None = None
) -> torch.Tensor:
    """The embedding rows of ``ids`` from a vocabulary-sharded (``Shard(0)``) DTensor ``weight``: each rank looks
    up the ids that fall in its rows (zeros for the others), and the partial sums are reduced to ``output``
    (``Shard(seq)`` under sequence parallelism, ``Replicate()`` for a whole sequence); the local tensor.

    ``padding_idx`` (an ``nn.Embedding``'s, a global row): as in ``F.embedding``, that row gets no gradient from
    the lookup; the rank holding it passes it on as its local row."""
    assert isinstance(weight, DTensor)
    mesh = weight.device_mesh
    local = weight.to_local()
    first = mesh.get_local_rank() * local.shape[0]
    shifted = ids - first
    outside = (shifted < 0) | (shifted >= local.shape[0])
    rows = F.embedding(
        shifted.masked_fill(outside, 0), local, padding_idx=_local_row(padding_idx, first, local.shape[0])
    )
    rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    partial = DTensor.from_local(rows, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [output]).to_local()


def _local_row(row: int | None, first: int, rows: int) -> int | None:
    """Global ``row`` as a row of the local shard ``[first, first + rows)``, or None where another rank holds it."""
    return row - first if row is not None and first <= row < first + rows else None


def _vocab_parallel_lookup(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_lookup(self.weight, ids, Shard(SEQUENCE_DIM), self.padding_idx)


def vocab_parallel_embedding() -> ParallelStyle:
    """Embedding rows (the vocabulary) split over tp, the output sequence-sharded (:class:`VocabParallelEmbedding`)."""
    return VocabParallelEmbedding()


def sequence_parallel_norm() -> ParallelStyle:
    """A norm over the hidden dim, run on this rank's positions; its weight replicated over tp."""
    return SequenceParallel(sequence_dim=SEQUENCE_DIM)


def gather_sequence(other_args: int = 0) -> ParallelStyle:
    """Before a block's column-parallel projections: all-gather the sequence-sharded first argument.

    ``other_args`` further positional arguments (RoPE tables, say) pass through untouched.
    """
    extra = (None,) * other_args
    return PrepareModuleInput(
        input_layouts=(Shard(SEQUENCE_DIM), *extra),
        desired_input_layouts=(Replicate(), *extra),
        use_local_output=True,
    )


def local_to_sequence_shard() -> ParallelStyle:
    """A block that runs on this rank's positions only, with weights that stay whole on every tp rank (an MoE
    block: each tp rank routes its own tokens through the whole router and experts). Its sequence-sharded input
    arrives as the local shard and its output is this rank's positions; the weights' gradients then hold only
    this rank's tokens and must be summed over tp (:func:`~lightning_d9d.plans.route_on_sequence_shards`)."""
    return PrepareModuleInput(
        input_layouts=Shard(SEQUENCE_DIM), desired_input_layouts=Shard(SEQUENCE_DIM), use_local_output=True
    )


def column_parallel() -> ParallelStyle:
    """Output features (attention heads, MLP columns) split over tp; input whole, output a local shard."""
    return ColwiseParallel()


def row_parallel_to_sequence() -> ParallelStyle:
    """Input features split over tp; the partial sums are reduce-scattered onto the sequence shards."""
    return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))


def per_head_norm() -> ParallelStyle:
    """A norm over ``head_dim`` applied to ``[B, T, heads, head_dim]`` with this rank's heads: its weight is
    replicated over tp and its gradient summed over the ranks' heads."""
    return SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)


def vocab_parallel_head() -> ParallelStyle:
    """LM head: gathers the sequence, computes this rank's vocabulary columns, and returns the logits as a
    ``DTensor`` sharded on the vocabulary dim (for :func:`loss_parallel`)."""
    return ColwiseParallel(
        input_layouts=Shard(SEQUENCE_DIM), output_layouts=Shard(-1), use_local_output=False
    )


# ---------------------------------------------------------------------------------------------- the plan
def parallelize_tensor(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """Apply ``plan`` (module name -> style) to ``module`` over the 1-D ``tp_mesh``, in place.

    ``parallelize_module`` registers a new ``DTensor`` Parameter per parallelized module, which would untie
    parameters that several modules share (tied embeddings). Shared parameters are tied again afterwards,
    provided every style gave them the same layout (an embedding and a head both split over the vocabulary).
    Where the plan targets torchao's float8 linears, their styles become torchao's float8 ones
    (:func:`~lightning_d9d.plans.fp8.float8_tensor_plan`).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_tensor needs the 1-D tp mesh, got {tp_mesh.ndim}-D {tp_mesh.mesh_dim_names}"
        )
    shared = _shared_parameters(module)
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    # float8 linears (converted before tp) cast around their collectives: torchao's styles in place of torch's
    # LoRA's adapted layers (adapted before tp) shard their adapters with the base weight
    parallelize_module(module, tp_mesh, lora_tensor_plan(module, float8_tensor_plan(module, plan)))
    # torch's SequenceParallel registers its replicated Parameters without their requires_grad: frozen ones
    # (LoRA's base, a user's frozen norms) would train
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    for uses in shared:
        first_module, first_name = uses[0]
        param = getattr(first_module, first_name)
        for owner, name in uses[1:]:
            other = getattr(owner, name)
            layouts = (getattr(param, "placements", None), getattr(other, "placements", None))
            if layouts[0] != layouts[1]:
                raise ValueError(
                    f"parallelize_tensor: a shared parameter ({first_name} of {type(first_module).__name__} and "
                    f"{name} of {type(owner).__name__}) got two layouts {layouts[0]} and {layouts[1]}; give "
                    "both modules styles that shard it alike (for tied embeddings: both over the vocabulary)"
                )
            setattr(owner, name, param)


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each Parameter registered under more than one ``(module, name)``: its registrations."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            uses.setdefault(id(param), []).append((owner, name))
    return [where for where in uses.values() if len(where) > 1]


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """torch's :func:`loss_parallel` (cross-entropy on vocabulary-sharded logits) when ``enabled``.

    The loss's forward *and* its backward must run inside it: backward dispatches the sharded log-softmax's
    own gradient ops.
    """
    if not enabled:
        yield
        return
    with loss_parallel():
        yield


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under :func:`loss_parallel` is a ``DTensor`` replicated over tp: its value as a plain
    tensor (what ``self.log``, the token weighting and Lightning's closure expect), still differentiable."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
