"""Head-parallel attention where cp does not divide the query heads: heads split over part of the cp ranks, keys
gathered over the rest.

Head-parallel attention (:mod:`~lightning_d9d.modules.head_parallel_attention`) gives each cp rank ``H / cp`` of a
rank's ``H`` query heads over the whole sequence, so cp must divide ``H``. Where it does not, the cp ranks are cut
into a grid (:func:`~lightning_d9d.compat.unflatten_mesh`): ``u = gcd(H, cp)`` consecutive cp ranks form a *head
group*, whose one all-to-all gives each of them ``H / u`` heads of the positions the ``u`` ranks hold together
(``T u / cp`` of them, :class:`GroupedSplit`); the ``a = cp / u`` ranks that hold the same heads then all-gather one
another's keys and values, so that each of those queries meets every key, by global position
(:class:`~lightning_d9d.modules.context_attention.AllGatherAttention` over the ``a`` groups). The output goes back
to the rank's own positions and every head with the second all-to-all. ``u = cp`` is plain head-parallel attention
and ``u = 1`` the plain all-gather path; both are chosen as such, not through this module.

Per attention layer and rank, in elements of ``B x D`` (``H_kv`` key/value heads, repeated ``r`` times where ``u``
does not divide them; ``T`` the whole sequence): the all-to-alls (q, k and v there, the output back) send
``2 T (H + H_kv r)(u - 1) / (u cp)``, the all-gather brings ``2 T H_kv r (a - 1) / cp`` of keys and values; a rank
attends ``T u / cp`` queries to ``T`` keys for ``H / u`` heads, the same work as either plain path.

Masks: causal by global position, a sliding window as a band on the gathered keys, and a packed batch's document
mask, whose rows the model builds for its own queries (``[B, 1, T / cp, T]``, as for the all-gather path) and this
path gathers over the head group (:meth:`HybridHeadParallelAttention.group_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.compat import unflatten_mesh
from lightning_d9d.modules.context_attention import AllGatherAttention, LoadBalancedSplit
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention

#: The names of the cp mesh's two dims under this path: ranks holding the same heads, ranks exchanging heads.
KEY_DIM, HEAD_DIM = "cp_keys", "cp_heads"


def head_group_size(heads: int, cp: int) -> int:
    """``gcd(heads, cp)``: the most cp ranks that can split ``heads`` query heads among themselves."""
    return math.gcd(heads, cp)


@dataclass(frozen=True)
class GroupedSplit(LoadBalancedSplit):
    """``cp`` groups of ``group_size`` consecutive ranks of the ``cp * group_size``-rank
    :class:`~lightning_d9d.modules.context_attention.LoadBalancedSplit`, each seen as one rank: group ``rank`` holds
    the positions of base ranks ``rank * group_size`` to ``(rank + 1) * group_size - 1``, ascending."""

    group_size: int = 1

    @property
    def chunks(self) -> int:
        return 2 * self.cp * self.group_size

    def positions(
        self, seq_len: int, rank: int | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        self.check(seq_len)
        group = self.rank if rank is None else rank
        base = LoadBalancedSplit(self.cp * self.group_size, 0)
        members = range(group * self.group_size, (group + 1) * self.group_size)
        held = torch.cat([base.positions(seq_len, rank=member, device=device) for member in members])
        return held.sort().values


@dataclass(frozen=True)
class HeadGroupLayout:
    """The ranks of one head group as :class:`~lightning_d9d.modules.head_parallel_attention.HeadParallelAttention`
    sees them: each member holds its base rank's positions, and "the sequence" is the positions of the whole group
    (:class:`GroupedSplit`), ascending."""

    group: GroupedSplit
    member: int

    @property
    def cp(self) -> int:
        return self.group.group_size

    @property
    def rank(self) -> int:
        return self.member

    def held_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Indices into the group's ``seq_len`` positions (ascending) of each member's part, member after member."""
        whole = seq_len * self.group.cp
        ascending = self.group.positions(whole, device=device)
        base = LoadBalancedSplit(self.group.cp * self.cp, 0)
        first = self.group.rank * self.cp
        parts = torch.cat([base.positions(whole, rank=first + m, device=device) for m in range(self.cp)])
        return torch.searchsorted(ascending, parts)

    def gather_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Indices that put the members' parts (member order) in the group's ascending order."""
        return torch.argsort(self.held_order(seq_len, device=device))


class HybridHeadParallelAttention:
    """Exact attention of this rank's queries, heads split over its head group and keys gathered over its key
    group (the module's docstring). ``__call__(q, k, v, document_mask=None, *, window=None, softcap=None)`` takes
    and returns ``[B, heads, T / cp, D]`` at this rank's positions, as
    :class:`~lightning_d9d.modules.context_attention.AllGatherAttention` does; ``to_heads`` / ``group_rows`` /
    :attr:`gather` / ``to_sequence`` are its steps, for an attention that runs the middle one itself."""

    def __init__(
        self, split: LoadBalancedSplit, head_group: dist.ProcessGroup, key_group: dist.ProcessGroup
    ) -> None:
        size = dist.get_world_size(head_group)
        if split.cp % size or dist.get_world_size(key_group) * size != split.cp:
            raise ValueError(
                f"HybridHeadParallelAttention: head groups of {size} and key groups of "
                f"{dist.get_world_size(key_group)} ranks do not tile cp={split.cp}"
            )
        self.split = split
        self.head_group = head_group
        self.grouped = GroupedSplit(split.cp // size, split.rank // size, group_size=size)
        self.heads = HeadParallelAttention(HeadGroupLayout(self.grouped, split.rank % size), head_group)
        self.gather = AllGatherAttention(self.grouped, key_group)

    def rank_heads(self, heads: int) -> slice:
        """Which of ``heads`` (the query heads this rank holds before :meth:`to_heads`) it attends after it."""
        return self.heads.rank_heads(heads)

    def to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, heads, T / cp, D]`` -> ``[B, heads / u, T u / cp, D]``: this rank's heads of its group's positions."""
        return self.heads.to_heads(q, k, v)

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        return self.heads.to_sequence(out)

    def group_rows(self, mask: torch.Tensor) -> torch.Tensor:
        """A mask's rows for this rank's queries (``[B, 1, T / cp, T]``) -> its head group's queries' rows
        (``[B, 1, T u / cp, T]``, ascending), gathered over the head group; a mask of one row for every query (a
        key padding mask, ``[B, 1, 1, T]``) is returned as it is."""
        if mask.shape[-2] == 1:
            return mask
        size = self.grouped.group_size
        local = mask.to(torch.uint8).contiguous()  # gloo gathers no bool
        parts = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(parts, local, group=self.head_group)
        rows = torch.cat(parts.view(size, *local.shape).unbind(0), dim=-2)
        order = self.heads.split.gather_order(rows.shape[-2], device=rows.device)
        return rows.index_select(-2, order).to(mask.dtype)

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
        q, k, v = self.to_heads(q, k, v)
        rows = None if document_mask is None else self.group_rows(document_mask)
        return self.to_sequence(self.gather(q, k, v, rows, window=window, softcap=softcap))

    def __repr__(self) -> str:
        size = self.grouped.group_size
        return (
            f"HybridHeadParallelAttention(cp={self.split.cp}, heads over {size}, keys over {self.grouped.cp})"
        )


# (cp ranks, head group size) -> (the default group they were made under, head group, key group)
_GROUPS: dict[tuple[tuple[int, ...], int], tuple[object, dist.ProcessGroup, dist.ProcessGroup]] = {}


def hybrid_head_parallel(
    split: LoadBalancedSplit, cp_mesh: DeviceMesh, group_size: int
) -> HybridHeadParallelAttention:
    """The path over the 1-D ``cp_mesh`` with head groups of ``group_size`` ranks (a divisor of cp between 1 and
    cp). Its groups are made once per process and cp group (a second model, or a second pipeline stage, of the same
    run reuses them: making them is collective over the cp ranks)."""
    cp = cp_mesh.size()
    if not 1 < group_size < cp or cp % group_size:
        raise ValueError(f"hybrid head-parallel attention: head groups of {group_size} ranks for cp={cp}")
    key = (tuple(cp_mesh.mesh.flatten().tolist()), group_size)
    world = dist.group.WORLD
    if key not in _GROUPS or _GROUPS[key][0] is not world:  # none yet, or made under an earlier default group
        grid = unflatten_mesh(cp_mesh, (cp // group_size, group_size), (KEY_DIM, HEAD_DIM))
        _GROUPS[key] = (world, grid[HEAD_DIM].get_group(), grid[KEY_DIM].get_group())
    _, head_group, key_group = _GROUPS[key]
    return HybridHeadParallelAttention(split, head_group, key_group)
