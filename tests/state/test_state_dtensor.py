"""Loading into and saving from a module sharded with FSDP2 on 2 gloo ranks; the distributed writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed import run_distributed
from state_helpers import (
    TinyConfig,
    TinyModel,
    assert_same_state,
    disk_state,
    module_state,
    read_checkpoint,
    tiny_mapper,
    write_checkpoint,
)
from torch.distributed.tensor import DTensor

from lightning_d9d.state import (
    CheckpointReader,
    Distribute,
    Sequential,
    ShardedWriter,
    load_into_module,
    save_from_module,
)

CFG = TinyConfig()  # odd sizes (7, 5, 3 experts): FSDP's dim-0 shards are uneven over 2 ranks


def _sharded_load_and_save(ckpt: str, export: str, by_rank: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(100 + dist.get_rank())  # different garbage on each rank: the load must overwrite it all
    model = TinyModel(CFG).to(torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    load_into_module(model, ckpt, tiny_mapper(CFG))
    state = model.state_dict()
    local_shapes = {
        key: tuple(value.to_local().shape) for key, value in state.items() if isinstance(value, DTensor)
    }
    full = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}

    # The same through the graph: a Distribute stage after the mapper gives DTensors with the module's placements.
    graph = Sequential([tiny_mapper(CFG), Distribute.from_module(model)])
    for result in CheckpointReader(ckpt).stream(graph):
        for key, value in result.outputs.items():
            expected = state[key]
            if isinstance(expected, DTensor):
                assert isinstance(value, DTensor) and value.placements == expected.placements, key
                assert torch.equal(value.to_local(), expected.to_local()), key

    save_from_module(model, export, tiny_mapper(CFG).inverse(), max_shard_bytes=300)

    # Distributed writer: each rank writes every other key of the disk layout into its own shards.
    disk = CheckpointReader(ckpt)
    keys = sorted(disk.keys())[dist.get_rank() :: dist.get_world_size()]
    with ShardedWriter(by_rank, max_shard_bytes=300, distributed=True) as writer:
        for key in keys:
            writer.add(key, disk.read(key))
    return {"full": full, "local_shapes": local_shapes}


def test_fsdp2_load_and_save_match_a_plain_load(tmp_path: Path) -> None:
    disk = disk_state(CFG)
    write_checkpoint(tmp_path / "ckpt", disk, files=3)
    args = (str(tmp_path / "ckpt"), str(tmp_path / "export"), str(tmp_path / "by_rank"))
    results = run_distributed(_sharded_load_and_save, 2, *args, timeout=120)

    expected = module_state(CFG, disk)
    for result in results:
        assert_same_state(result["full"], expected)
    # Really sharded: rank 0 holds the first ceil(n/2) rows, rank 1 the rest.
    assert results[0]["local_shapes"]["embed.weight"] == (4, CFG.dim)
    assert results[1]["local_shapes"]["embed.weight"] == (3, CFG.dim)
    assert results[1]["local_shapes"]["layers.0.experts.w1"] == (1, CFG.ffn, CFG.dim)

    assert_same_state(read_checkpoint(tmp_path / "export"), disk)
    assert_same_state(read_checkpoint(tmp_path / "by_rank"), disk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["by_rank", "ckpt", "export"]  # no temporaries left
