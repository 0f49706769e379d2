"""Context parallelism's sequence layout and its portable exact attention (CPU/gloo and GPUs alike).

The sequence is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``: under
a causal mask early chunks attend to few keys and late chunks to many, so pairing the ``r``-th earliest with the
``r``-th latest gives every rank the same attention work (causal load balancing).

:class:`AllGatherAttention` attends this rank's queries to the keys and values of the whole sequence: it
all-gathers K and V over the cp group (the backward reduce-scatters their gradients: each rank's keys serve
every rank's queries), puts them back in sequence order and runs ``scaled_dot_product_attention`` with an
explicit causal mask from the global positions of this rank's queries, or with a packed batch's document mask
(this rank's queries against every key, ``[B, 1, T / cp, T]``, built once per forward by the model from the
positions :func:`gather_positions` collects). A sliding-window layer adds its band to either mask
(:func:`window_band`), and an attention logit soft cap computes the scores itself (:func:`masked_attention`).
Memory for K/V grows with the whole sequence, which is fine for the moderate cp degrees this path is for.

:class:`TorchRingAttention` is torch's own context-parallel attention (the DTensor SDPA dispatcher of
``torch.distributed.tensor.experimental``): flash / memory-efficient / cuDNN kernels per K/V block, merged by their
log-sum-exp, with the same head-and-tail layout. It has CUDA kernels only and takes no mask: chosen by ``"auto"``
it hands packed batches and sliding-window layers to the all-gather path (logged once); asked for by name it
refuses them.
:class:`~lightning_d9d.modules.head_parallel_attention.HeadParallelAttention` (``"heads"``, Ulysses) splits the
heads instead: two all-to-alls per layer around the model's own attention over the whole sequence.
:func:`context_attention` picks one (``"auto"``: torch's on CUDA meshes, all-gather elsewhere) and logs the
choice once.

:func:`context_attention_work` counts the (query, key) pairs each rank's queries attend in a packed batch: how
evenly the head-and-tail split shares the work of a kernel that skips masked pairs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_d9d.compat import import_private
from lightning_d9d.modules.attention import ContextAttentionFn, HeadParallelContext, repeat_kv
from lightning_d9d.modules.documents import attended_keys
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention

log = logging.getLogger("lightning_d9d.modules")

#: The context-parallel attention paths by name (``ParallelOptions.context_attention``): ``"heads"`` splits the
#: heads instead of the queries (:mod:`~lightning_d9d.modules.head_parallel_attention`).
CONTEXT_ATTENTION = ("auto", "all_gather", "torch_ring", "heads")


def check_context_attention(value: str, *, owner: str) -> str:
    """Refuse an unknown ``context_attention`` name (before any process group), naming ``owner``."""
    if value not in CONTEXT_ATTENTION:
        raise ValueError(
            f"{owner}: context_attention={value!r}; choose one of {', '.join(map(repr, CONTEXT_ATTENTION))}"
        )
    return value


@dataclass(frozen=True)
class LoadBalancedSplit:
    """Which positions of each sequence cp rank ``rank`` of ``cp`` holds (chunks ``rank`` and
    ``2cp - 1 - rank`` of ``2cp``), and how to cut tensors along the sequence accordingly."""

    cp: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.cp:
            raise ValueError(f"LoadBalancedSplit: rank ({self.rank}) must be in [0, cp={self.cp})")

    @property
    def chunks(self) -> int:
        return 2 * self.cp

    def check(self, seq_len: int) -> None:
        """Raise ``ValueError`` with the numbers unless ``seq_len`` cuts into ``2 * cp`` equal chunks."""
        if seq_len % self.chunks != 0:
            raise ValueError(
                f"context parallelism needs a sequence length divisible by 2*cp: {seq_len} % (2*{self.cp}) = "
                f"{seq_len % self.chunks}; pad or cut the sequences to a multiple of {self.chunks}"
            )

    def positions(
        self, seq_len: int, rank: int | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """The global positions (``int64``, ascending) that ``rank`` (this split's by default) holds of a
        ``seq_len``-long sequence: ``seq_len / cp`` of them."""
        self.check(seq_len)
        rank = self.rank if rank is None else rank
        chunk = seq_len // self.chunks
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail_start = (self.chunks - 1 - rank) * chunk
        return torch.cat((head, torch.arange(tail_start, tail_start + chunk, device=device)))

    def local_positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """This rank's global positions, given the length of the part it holds (``seq_len / cp``)."""
        return self.positions(local_len * self.cp, device=device)

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``tensor`` along ``dim`` (the sequence): its two chunks, in order."""
        return tensor.index_select(dim, self.positions(tensor.shape[dim], device=tensor.device))

    def held_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Every rank's positions, rank after rank: indices that cut a sequence into the concatenation of every
        rank's part (rank order)."""
        return torch.cat([self.positions(seq_len, rank=r, device=device) for r in range(self.cp)])

    def gather_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Indices that put the concatenation of every rank's part (rank order) back in sequence order."""
        return torch.argsort(self.held_order(seq_len, device=device))


def gather_positions(local: torch.Tensor, split: LoadBalancedSplit, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``[B, T / cp]`` part of a ``[B, T]`` integer tensor (a packed batch's ``position_ids``, a
    padding mask) ->
    the whole ``[B, T]``, in sequence order, on every rank of the cp ``group`` (no autograd: ids, not activations).

    A packed row's document mask needs every key's document, and keys come from every rank; the positions are
    a few bytes per token, so the model gathers them once per forward instead of a mask per layer."""
    if dist.get_world_size(group) != split.cp:
        raise ValueError(
            f"gather_positions: the cp group has {dist.get_world_size(group)} ranks, the split {split.cp}"
        )
    local = local.contiguous()
    parts = local.new_empty((split.cp * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(parts, local, group=group)
    whole = torch.cat(parts.view(split.cp, *local.shape).unbind(0), dim=1)
    return whole.index_select(1, split.gather_order(whole.shape[1], device=whole.device))


def context_attention_work(position_ids: torch.Tensor, split: LoadBalancedSplit) -> torch.Tensor:
    """``[cp]`` int64: the (query, key) pairs the queries of each cp rank attend under the document mask of the
    packed batch ``position_ids`` (``[B, T]``, the whole rows, before the split), summed over the batch.

    That is the work of a kernel that skips masked pairs (flash-style varlen or block-sparse attention); the
    all-gather path's dense masked SDPA does ``T / cp x T`` per row on every rank whatever the mask. With one
    document per row the head-and-tail split makes the ranks' work equal up to the chunk's diagonal."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, sequence], got shape {tuple(position_ids.shape)}")
    per_query = attended_keys(position_ids).sum(
        0
    )  # [T]: over the rows, each of which every rank holds a part of
    seq_len = per_query.shape[0]
    return torch.stack(
        [per_query[split.positions(seq_len, rank=r, device=per_query.device)].sum() for r in range(split.cp)]
    )


def window_band(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """``[Tq, Tk]`` booleans: key ``j`` lies in the sliding window of query ``i``, ``pos(i) - window < pos(j)``
    (``transformers``' ``sliding_window_overlay``: the window holds the query itself and the ``window - 1`` keys
    before it). With the causal mask, or a packed batch's document mask (positions within a document differ by
    their distance in the row), it is the windowed layer's mask."""
    if window < 1:
        raise ValueError(f"a sliding window must hold at least the query itself, got window={window}")
    return query_positions[:, None] - key_positions[None, :] < window


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, softcap: float | None = None
) -> torch.Tensor:
    """Attention of ``q`` (``[B, H, Tq, D]``) over ``k``/``v`` (``[B, H_kv, Tk, D]``, ``H_kv`` dividing ``H``)
    with the boolean ``mask`` (True attends; every query must see a key), scaled by ``1 / sqrt(D)``. Without
    ``softcap`` that is SDPA; with it the logits are capped at ``softcap * tanh(logits / softcap)`` before the mask
    (Gemma2's attention, as ``transformers`` computes it), which SDPA cannot take: the scores are computed here,
    ``[B, H, Tq, Tk]`` per layer, and the softmax runs in fp32."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


class _GatherParts(torch.autograd.Function):
    """``x`` of every rank of ``group`` stacked on a new leading dim (rank order); the backward sums each
    rank's gradient over the group and hands every rank its own part (a reduce-scatter).

    Our own instead of ``torch.distributed.nn.functional.all_gather``: on gloo its backward scatters from
    group ranks as if they were global ranks, which fails on any subgroup (cp under dp_shard, say).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        world = dist.get_world_size(group)
        # Gathered along dim 0, which must keep its rank (gloo checks): [world * B, ...], then split.
        parts = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(parts, x.contiguous(), group=group)
        return parts.view(world, *x.shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group: dist.ProcessGroup = ctx.group  # type: ignore[attr-defined]
        mine = grad.new_empty(grad.shape[1:])
        stacked = grad.reshape(-1, *grad.shape[2:]).contiguous()  # [world * B, ...], as forward gathered
        dist.reduce_scatter_tensor(mine, stacked, op=dist.ReduceOp.SUM, group=group)
        return mine, None


class AllGatherAttention:
    """Exact causal attention of this rank's queries against the whole sequence's keys and values.

    ``__call__(q, k, v)`` takes ``[B, heads, T / cp, head_dim]`` tensors holding this rank's positions (see
    :class:`LoadBalancedSplit`); ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention). With
    ``document_mask`` (``[B, 1, T / cp, T]``, its queries' rows of a packed batch's document mask) that mask
    replaces the causal one.
    """

    def __init__(self, split: LoadBalancedSplit, group: dist.ProcessGroup) -> None:
        if dist.get_world_size(group) != split.cp:
            raise ValueError(
                f"AllGatherAttention: the cp group has {dist.get_world_size(group)} ranks, the split {split.cp}"
            )
        self.split = split
        self.group = group

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T / cp, D]`` parts of every cp rank -> ``[B, H, T, D]`` in sequence order (with autograd)."""
        parts = _GatherParts.apply(x, self.group)  # [cp, B, H, T / cp, D]
        whole = torch.cat(parts.unbind(0), dim=2)
        return whole.index_select(2, self.split.gather_order(whole.shape[2], device=x.device))

    def causal_mask(self, local_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """``[T / cp, T]`` booleans: query ``i`` (at its global position) may see key ``j`` iff ``j <= pos(i)``;
        with a sliding ``window`` also ``pos(i) - window < j`` (:func:`window_band`)."""
        query_positions = self.split.local_positions(local_len, device=device)
        key_positions = torch.arange(local_len * self.split.cp, device=device)
        causal = query_positions[:, None] >= key_positions[None, :]
        return causal if window is None else causal & window_band(query_positions, key_positions, window)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_mask: torch.Tensor | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``window``: a sliding window over the keys (its band added to the causal or the document mask);
        ``softcap``: the logits capped at ``softcap * tanh(logits / softcap)`` (:func:`masked_attention`)."""
        k_all, v_all = self.gather_sequence(k), self.gather_sequence(v)
        local_len = q.shape[2]
        if document_mask is None:
            mask = self.causal_mask(local_len, q.device, window)
        else:
            mask = document_mask
            if window is not None:
                query_positions = self.split.local_positions(local_len, device=q.device)
                keys = torch.arange(k_all.shape[2], device=q.device)
                mask = mask & window_band(query_positions, keys, window)
        if mask.shape[-2:] != (local_len, k_all.shape[2]):
            raise ValueError(
                f"AllGatherAttention: a mask of shape {tuple(mask.shape)} for {local_len} local queries and "
                f"{k_all.shape[2]} keys; a packed batch's mask under cp is [B, 1, T / cp, T] "
                "(documents.document_causal_mask of the gathered positions, this rank's queries)"
            )
        return masked_attention(q, k_all, v_all, mask, softcap=softcap)

    def __repr__(self) -> str:
        return f"AllGatherAttention(cp={self.split.cp}, rank={self.split.rank})"


_TORCH_CP = "torch.distributed.tensor.experimental._attention"


class TorchRingAttention:
    """torch's context-parallel SDPA (CUDA only): this rank's ``q``/``k``/``v`` become sequence-sharded DTensors
    and ``scaled_dot_product_attention`` on them runs torch's ring kernels, forward and backward.

    torch's kernels need as many K/V heads as query heads, so grouped K/V heads are repeated first. Its
    load balancing must be on: it then assumes exactly the head-and-tail layout of :class:`LoadBalancedSplit`.

    torch's kernels take no mask: a packed batch (``document_mask`` given) or a sliding window shorter than the
    sequence goes to ``packed`` (the all-gather path, which ``"auto"`` sets; logged once), and is refused when
    there is none (``"torch_ring"`` by name).
    """

    def __init__(
        self, split: LoadBalancedSplit, mesh: DeviceMesh, packed: AllGatherAttention | None = None
    ) -> None:
        if mesh.device_type != "cuda":
            raise ValueError(
                f"context_attention='torch_ring' needs a CUDA mesh (torch has CUDA kernels only), got a "
                f"{mesh.device_type!r} mesh; use 'all_gather' (or 'auto')"
            )
        if mesh.size() != split.cp:
            raise ValueError(f"TorchRingAttention: the cp mesh has {mesh.size()} ranks, the split {split.cp}")
        options = import_private(_TORCH_CP, "_cp_options")
        if not options.enable_load_balance:
            raise ValueError(
                "torch's context-parallel load balancing is off (torch.distributed.tensor.experimental._attention."
                "_cp_options.enable_load_balance = False): lightning_d9d's sequence layout needs it on"
            )
        import_private(_TORCH_CP, "_enable_context_parallel_dispatcher")()
        self.split = split
        self.mesh = mesh
        self.packed = packed

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_mask: torch.Tensor | None = None,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """``window``: a sliding window over the keys, which torch's kernels cannot take either: a window shorter
        than the sequence goes to ``packed`` like a document mask (logged once), or is refused without it; one
        at least as long as the sequence masks nothing the causal mask keeps, and the ring runs."""
        seq_len = q.shape[2] * self.split.cp
        if window is not None and window < seq_len:
            if self.packed is None:
                raise ValueError(
                    f"a sliding window of {window} on {seq_len} tokens under context_attention='torch_ring': "
                    "torch's ring kernels take no window mask; use context_attention='auto' (the all-gather "
                    "path for windowed layers, torch's ring for the others) or 'all_gather'"
                )
            _log_once(
                "window",
                "context-parallel attention: sliding-window layers take all_gather (torch's ring kernels take "
                "no window mask), cp=%d",
                self.split.cp,
            )
            return self.packed(q, k, v, document_mask, window=window)
        if document_mask is not None:
            if self.packed is None:
                raise ValueError(
                    "a packed batch (position_ids restarting per document) under context_attention='torch_ring': "
                    "torch's ring kernels take no document mask; use context_attention='auto' (the all-gather "
                    "path for packed batches, torch's ring for the others) or 'all_gather'"
                )
            _log_once(
                "packed",
                "context-parallel attention: packed batches take all_gather (torch's ring "
                "kernels take no document mask), cp=%d",
                self.split.cp,
            )
            return self.packed(q, k, v, document_mask)
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        placements = [Shard(2)]
        q_d, k_d, v_d = (
            DTensor.from_local(t.contiguous(), self.mesh, placements, run_check=False) for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True)
        if not isinstance(out, DTensor):  # the dispatcher returns the sharded output
            raise TypeError(f"torch's context-parallel SDPA returned a {type(out).__name__}, not a DTensor")
        return out.to_local()

    def __repr__(self) -> str:
        return f"TorchRingAttention(cp={self.split.cp}, rank={self.split.rank})"


_logged: set[str] = set()


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info(message, *args)


def context_attention(
    split: LoadBalancedSplit, mesh: DeviceMesh, name: str = "auto"
) -> ContextAttentionFn | HeadParallelContext:
    """The context-parallel attention called ``name`` (one of :data:`CONTEXT_ATTENTION`) over the 1-D cp
    ``mesh``; ``"auto"`` is torch's ring kernels on CUDA (packed batches on the all-gather path, which takes
    their document mask) and the portable all-gather path elsewhere; ``"heads"`` the head-parallel exchanges
    (:class:`~lightning_d9d.modules.head_parallel_attention.HeadParallelAttention`), asked for by name only. The
    choice is logged once per process (INFO, ``lightning_d9d.modules``)."""
    if name not in CONTEXT_ATTENTION:
        raise ValueError(
            f"context_attention={name!r}: choose one of {', '.join(map(repr, CONTEXT_ATTENTION))}"
        )
    chosen = name if name != "auto" else ("torch_ring" if mesh.device_type == "cuda" else "all_gather")
    attention: ContextAttentionFn | HeadParallelContext
    if chosen == "heads":
        attention = HeadParallelAttention(split, mesh.get_group())
    elif chosen == "torch_ring":
        packed = AllGatherAttention(split, mesh.get_group()) if name == "auto" else None
        attention = TorchRingAttention(split, mesh, packed)
    else:
        attention = AllGatherAttention(split, mesh.get_group())
    why = "asked for" if name != "auto" else f"auto on a {mesh.device_type} mesh"
    _log_once(chosen, "context-parallel attention: %s (%s), cp=%d", chosen, why, split.cp)
    return attention
