"""Head-parallel context parallelism (Ulysses): each cp rank attends the whole sequence for some of the heads.

Under cp a rank holds ``T / cp`` positions of every sequence (the load-balanced head-and-tail chunks of
:class:`~lightning_d9d.modules.context_attention.LoadBalancedSplit`) and every head. :meth:`HeadParallelAttention.
to_heads` exchanges this rank's rotated ``q``/``k``/``v`` over the cp group with one all-to-all so that it holds
all ``T`` positions, in sequence order, of ``heads / cp`` query heads and their key/value heads; the model's own
attention runs on them as in one process (its backend, its document mask, sliding window, soft cap or sinks),
and :meth:`HeadParallelAttention.to_sequence` turns the output back with a second all-to-all. RoPE runs before
the exchange, each token rotated by its true position (the model's positions under cp), so nothing downstream
needs to know where a position came from.

Rank ``r`` of the cp group attends query heads ``r * heads / cp`` to ``(r + 1) * heads / cp - 1`` of the heads
it holds (under tp: of its tp rank's); a per-head parameter (attention sinks) is sliced alike
(:meth:`HeadParallelAttention.rank_heads`). Grouped key/value heads split alike when cp divides them; where
fewer key/value heads than that, each is repeated before the exchange (:func:`kv_repeats`) until cp divides
them, which keeps every query head's key/value head on its rank for ``kv_repeats`` times the key/value traffic.
Query heads that cp does not divide take :mod:`~lightning_d9d.modules.hybrid_attention` (heads split over part of
the cp ranks, keys gathered over the rest).

Both exchanges are ``torch.distributed``'s functional all-to-all with autograd (its backward is the all-to-all
back), which ``torch.compile`` traces: :func:`~lightning_d9d.compat.all_to_all_autograd`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_d9d.compat import all_to_all_autograd
from lightning_d9d.modules.attention import HeadParallelContext, repeat_kv


class SequenceLayout(Protocol):
    """Which positions of each sequence each cp rank holds (:class:`~lightning_d9d.modules.context_attention.
    LoadBalancedSplit`)."""

    @property
    def cp(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def held_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor: ...

    def gather_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor: ...


def kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each of ``kv_heads`` key/value heads is repeated so that cp divides them: 1 where it does;
    else ``cp / gcd(kv_heads, cp)``, which divides ``heads / kv_heads`` whenever cp divides ``heads``."""
    return cp // math.gcd(kv_heads, cp)


class HeadParallelAttention(HeadParallelContext):
    """The two all-to-alls of head-parallel attention over the cp ``group`` (see the module's docstring).

    ``to_heads(q, k, v)``: ``[B, heads, T / cp, D]`` (this rank's positions, ``k``/``v`` with ``kv_heads``) ->
    ``[B, heads / cp, T, D]`` and ``[B, kv_heads * kv_repeats / cp, T, D]`` in sequence order. ``to_sequence``:
    the attention's ``[B, heads / cp, T, D]`` -> ``[B, heads, T / cp, D]`` at this rank's positions.
    """

    def __init__(self, split: SequenceLayout, group: dist.ProcessGroup) -> None:
        if dist.get_world_size(group) != split.cp:
            raise ValueError(
                f"HeadParallelAttention: the cp group has {dist.get_world_size(group)} ranks, the split {split.cp}"
            )
        self.split = split
        self.group = group

    def rank_heads(self, heads: int) -> slice:
        """Which of ``heads`` (the query heads this rank held before :meth:`to_heads`) it attends after it."""
        cp = self.split.cp
        if heads % cp:
            raise ValueError(
                f"head-parallel attention: cp ({cp}) must divide the {heads} query heads of a rank"
            )
        share = heads // cp
        return slice(self.split.rank * share, (self.split.rank + 1) * share)

    def to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, heads, local_len, head_dim = q.shape
        cp = self.split.cp
        if heads % cp or heads % k.shape[1] or k.shape[:3] != v.shape[:3] or k.shape[-1] != head_dim:
            raise ValueError(
                f"head-parallel attention over cp={cp} takes q [B, heads, T / cp, D] with cp dividing heads, k "
                f"[B, kv_heads, T / cp, D] whose heads divide them and v of k's heads (any head size), got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        repeats = kv_repeats(heads, k.shape[1], cp)
        parts = [self._by_rank(x) for x in (q, *(repeat_kv(x, repeats) for x in (k, v)))]
        # One exchange for all three: block j of dim 0 holds rank j's heads of q, k and v at this rank's
        # positions, flattened (v's head size may differ from q's and k's: MLA's does).
        sizes = [part[0, 0].numel() for part in parts]
        outgoing = torch.cat([part.reshape(cp, batch, -1) for part in parts], dim=2)
        incoming = all_to_all_autograd(outgoing.contiguous(), self.group)  # block i: rank i's positions
        seq_len = cp * local_len
        order = self.split.gather_order(seq_len, device=q.device)
        out = []
        for piece, part in zip(incoming.split(sizes, dim=2), parts, strict=True):
            share, size = part.shape[2], part.shape[-1]
            # [cp, B, h, T / cp, D] -> [B, h, T, D]: rank 0's positions, then rank 1's, ... -> sequence order
            whole = piece.reshape(cp, batch, share, local_len, size).permute(1, 2, 0, 3, 4)
            out.append(whole.reshape(batch, share, seq_len, size).index_select(2, order))
        q_out, k_out, v_out = out
        return q_out, k_out, v_out

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        batch, heads, seq_len, head_dim = out.shape
        cp = self.split.cp
        # sequence order -> every rank's positions in rank order, then block i of dim 0 to rank i
        held = out.index_select(2, self.split.held_order(seq_len, device=out.device))
        outgoing = held.view(batch, heads, cp, seq_len // cp, head_dim).permute(2, 0, 1, 3, 4)
        incoming = all_to_all_autograd(outgoing.contiguous(), self.group)  # block i: rank i's heads
        return incoming.permute(1, 0, 2, 3, 4).reshape(batch, cp * heads, seq_len // cp, head_dim)

    def _by_rank(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, h, T / cp, D]`` -> ``[cp, B, h / cp, T / cp, D]``: the heads each cp rank attends."""
        batch, heads, local_len, head_dim = x.shape
        return x.view(batch, self.split.cp, heads // self.split.cp, local_len, head_dim).transpose(0, 1)

    def __repr__(self) -> str:
        return f"HeadParallelAttention(cp={self.split.cp}, rank={self.split.rank})"
