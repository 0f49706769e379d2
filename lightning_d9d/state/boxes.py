"""DCP for ``DTensor``s whose local part is several boxes of the global tensor.

``torch.distributed.checkpoint`` describes every rank's part of a ``DTensor`` as one box (an offset and a size per
dimension). A ``_StridedShard`` placement breaks that: under expert-tensor parallelism
(:mod:`lightning_d9d.plans.expert_tensor`) a fused gate/up weight is ``_StridedShard(dim, split_factor=2)`` over
tp, so tp rank ``r`` holds the ``r``-th ``1/tp`` of the gate columns *and* the ``r``-th ``1/tp`` of the up columns:
two boxes, which torch 2.13's DCP would save as one (ranks' boxes overlapping: the save fails) and load into wrongly.

Here each such tensor's local part is described as its boxes (:func:`local_boxes`), and the planners hand DCP one
chunk per box: :class:`BoxedSavePlanner` writes each box as a chunk of its own, :class:`BoxedLoadPlanner` reads
the stored chunks into each box of the local part. On disk it is an ordinary DCP checkpoint of whole tensors in
chunks, so it loads into any layout (tp = 1, another tp, FSDP only), and a checkpoint of any layout loads into
the strided one. Tensors whose local part is one box take DCP's own path unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Placement, Shard


@dataclass(frozen=True)
class Box:
    """One box of a rank's local part: where it lies in the global tensor (``offsets``, ``sizes``) and where in the
    local tensor (``local_offsets``, same ``sizes``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """The part of the local tensor the box covers (a view)."""
        view = local
        for dim, (start, size) in enumerate(zip(self.local_offsets, self.sizes, strict=True)):
            view = view.narrow(dim, start, size)
        return view

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


def held_indices(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coordinate: Sequence[int],
    mesh_shape: tuple[int, ...],
) -> list[torch.Tensor]:
    """For each dimension of a global tensor of ``shape``, the global indices the rank at ``coordinate`` (of a mesh
    of ``mesh_shape``) holds, in local order: the placements applied left to right, as torch cuts them (``Shard``:
    ``torch.chunk`` into the mesh dim's size; ``_StridedShard(split_factor=s)``: ``torch.chunk`` into ``s``, then
    each of those into the mesh dim's size, the rank taking its piece of each)."""
    indices = [torch.arange(size) for size in shape]
    strided = _strided_shard_type()
    for mesh_dim, placement in enumerate(placements):
        ways, rank = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, strided):
            cut: Any = placement  # torch's private class: a dim and a split factor
            firsts = indices[cut.dim].chunk(int(cut.split_factor))
            indices[cut.dim] = torch.cat([_piece(first, ways, rank) for first in firsts])
        elif isinstance(placement, Shard):
            indices[placement.dim] = _piece(indices[placement.dim], ways, rank)
    return indices


def _strided_shard_type() -> type:
    # compat imports Lightning, which the conversion command (whose loads run through these planners, over plain
    # tensors only) must not pay for: imported where a DTensor is met
    from lightning_d9d.compat import strided_shard_type

    found: type = strided_shard_type()
    return found


def _piece(indices: torch.Tensor, ways: int, rank: int) -> torch.Tensor:
    pieces = indices.chunk(ways)
    return pieces[rank] if rank < len(pieces) else indices[:0]


def _runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each run of consecutive global indices."""
    if indices.numel() == 0:
        return []
    breaks = (torch.nonzero(indices[1:] - indices[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, indices.numel()]
    return [(start, int(indices[start]), end - start) for start, end in zip(starts, ends, strict=True)]


def local_boxes(tensor: DTensor) -> list[Box] | None:
    """The boxes of ``tensor``'s local part, or ``None`` where it is one box (or none: DCP's own path)."""
    strided = _strided_shard_type()
    if not any(isinstance(placement, strided) for placement in tensor.placements):
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    indices = held_indices(
        tuple(tensor.shape), tuple(tensor.placements), coordinate, tuple(tensor.device_mesh.shape)
    )
    runs = [_runs(dim_indices) for dim_indices in indices]
    boxes = [
        Box(
            offsets=tuple(run[1] for run in combination),
            sizes=tuple(run[2] for run in combination),
            local_offsets=tuple(run[0] for run in combination),
        )
        for combination in itertools.product(*runs)
    ]
    return boxes if len(boxes) > 1 else None


def _boxed(state_dict: dict[str, Any]) -> dict[str, list[Box]]:
    found = {}
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor) and (boxes := local_boxes(value)) is not None:
            found[fqn] = boxes
    return found


def _box_at(boxes: dict[str, list[Box]], index: MetadataIndex) -> Box | None:
    offset = None if index.offset is None else tuple(index.offset)
    return next((box for box in boxes.get(index.fqn, ()) if box.offsets == offset), None)


class BoxedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` writing a several-box ``DTensor`` as one chunk per box (module docstring)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._boxes = _boxed(self.state_dict)
        if not self._boxes:
            return plan
        items = [item for item in plan.items if item.index.fqn not in self._boxes]
        for fqn, boxes in self._boxes.items():
            tensor: DTensor = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(tensor.to_local())
            items += [
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(box.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=box.chunk, properties=properties, size=tensor.size()),
                )
                for box in boxes
            ]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        box = _box_at(getattr(self, "_boxes", {}), index)
        if box is None:
            return super().lookup_object(index)
        return box.of(self.state_dict[index.fqn].to_local())


class BoxedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading into each box of a several-box ``DTensor`` (module docstring)."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self._boxes = _boxed(self.state_dict)
        if not self._boxes:
            return plan
        items = [item for item in plan.items if item.dest_index.fqn not in self._boxes]
        for fqn, boxes in self._boxes.items():
            stored = self.metadata.state_dict_metadata[fqn] if self.metadata is not None else None
            if not isinstance(stored, TensorStorageMetadata):
                continue  # DCP's own plan refused it (a missing key, another type) or left it out
            items += create_read_items_for_chunk_list(fqn, stored, [box.chunk for box in boxes])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        box = _box_at(getattr(self, "_boxes", {}), index)
        if box is None:
            return super().lookup_tensor(index)
        return box.of(self.state_dict[index.fqn].to_local())
