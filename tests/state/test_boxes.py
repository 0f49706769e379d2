"""The boxes of a ``DTensor``'s local part (``lightning_d9d/state/boxes.py``), against torch's own cut: on a fake
process group (no peers: every rank's part cut locally by ``distribute_tensor(src_data_rank=None)``), the global
indices :func:`held_indices` names are the values torch hands that rank, for plain and strided shards, on one and
two mesh dims, even and uneven. The round trip through a checkpoint runs in
``tests/models/hf/test_expert_tensor_parallel.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_d9d.compat import strided_shard_type
from lightning_d9d.state.boxes import Box, held_indices, local_boxes


def strided(dim: int, split_factor: int = 2) -> Placement:
    placement: Placement = strided_shard_type()(dim, split_factor=split_factor)
    return placement


CASES: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]] = [
    # (global shape, mesh shape, placements)
    ((3, 4, 8), (2,), (strided(2),)),  # our fused gate/up over tp=2
    ((3, 12, 4), (4,), (strided(1),)),  # transformers' over tp=4
    ((4, 4, 8), (2, 2), (Shard(0), strided(2))),  # FSDP's experts dim, then tp
    ((5, 4, 8), (2, 2), (Shard(0), strided(2))),  # FSDP's uneven split
    ((4, 6), (2, 2), (Replicate(), Shard(1))),
    ((7, 3), (4,), (Shard(0),)),  # torch.chunk's uneven split: 2, 2, 2, 1
    ((12,), (2, 2), (strided(0, 3), Shard(0))),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), CASES, ids=[str(case[2]) for case in CASES])
def test_held_indices_are_the_elements_torch_gives_each_rank(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    codes = torch.arange(torch.Size(shape).numel()).reshape(shape)  # each element's flat global index
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            local = distribute_tensor(codes, mesh, list(placements), src_data_rank=None).to_local()
            coordinate = mesh.get_coordinate()
            assert coordinate is not None
            indices = held_indices(shape, placements, coordinate, mesh_shape)
            assert torch.equal(local, codes[torch.meshgrid(*indices, indexing="ij")]), (rank, placements)
        finally:
            dist.destroy_process_group()


def test_a_strided_shard_is_two_boxes_and_a_plain_one_takes_dcp_s_path() -> None:
    """Rank 1 of tp=2 on our fused gate/up ``[E, hidden, 2 * ffn]`` (ffn 4): the gate's columns 2-3 and the up's
    6-7, each a box of its own, found where they lie in the local part."""
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        codes = torch.arange(3 * 5 * 8).reshape(3, 5, 8)
        tensor = distribute_tensor(codes, mesh, [strided(2)], src_data_rank=None)
        boxes = local_boxes(tensor)
        assert boxes == [
            Box(offsets=(0, 0, 2), sizes=(3, 5, 2), local_offsets=(0, 0, 0)),
            Box(offsets=(0, 0, 6), sizes=(3, 5, 2), local_offsets=(0, 0, 2)),
        ]
        for box in boxes:
            region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
            assert torch.equal(box.of(tensor.to_local()), codes[region])
        assert local_boxes(distribute_tensor(codes, mesh, [Shard(2)], src_data_rank=None)) is None
    finally:
        dist.destroy_process_group()
