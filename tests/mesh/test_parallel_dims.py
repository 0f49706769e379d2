from __future__ import annotations

import pytest
import torch.distributed as dist
from distributed import run_distributed

from lightning_d9d.mesh import ParallelDims


def test_dp_shard_minus_one_takes_the_rest() -> None:
    dims = ParallelDims(dp_replicate=2).resolve(8)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.fsdp, dims.world_size) == (2, 4, 8, 4, 8)


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        ({"dp_shard": 3}, 4, "= 3 does not match the world size (4)"),
        ({"dp_replicate": 3}, 4, "= 3 does not divide the world size (4)"),
        ({"dp_shard": 2, "ep": 4}, 2, "ep (4) must divide dp_shard*cp*tp"),
    ],
)
def test_bad_degrees_name_the_value(kwargs: dict, world: int, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ParallelDims(**kwargs).resolve(world)
    assert message in str(error.value)


@pytest.mark.parametrize(("kwargs", "message"), [({"tp": -2}, "tp (-2)"), ({"dp_shard": 0}, "dp_shard (0)")])
def test_negative_or_zero_degrees(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(**kwargs)


def test_non_integer_degree() -> None:
    with pytest.raises(TypeError, match="pp must be an int"):
        ParallelDims(pp=2.0)  # type: ignore[arg-type]


def test_mesh_needs_resolved_degrees() -> None:
    with pytest.raises(RuntimeError, match="resolve"):
        ParallelDims().build_mesh("cpu")


def _views(kwargs: dict) -> dict[str, tuple[int, list[int]]]:
    dims = ParallelDims(**kwargs).resolve(dist.get_world_size()).build_mesh("cpu")
    views = {}
    for view in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "batch", "fsdp", "loss"):
        mesh = dims.mesh_for(view)
        views[view] = (mesh.size(), sorted(dist.get_process_group_ranks(mesh.get_group())))
    views["hsdp"] = (dims.mesh_for("hsdp").size(), [])
    return views


def test_named_views_group_the_right_ranks() -> None:
    # 8 ranks as pp=2 x dp_replicate=2 x dp_shard=2 (row-major, pp outermost)
    results = run_distributed(_views, 8, {"pp": 2, "dp_replicate": 2, "dp_shard": 2})
    rank0 = results[0]
    assert rank0["pp"] == (2, [0, 4])
    assert rank0["dp_replicate"] == (2, [0, 2])
    assert rank0["dp_shard"] == (2, [0, 1])
    assert rank0["dp"] == rank0["batch"] == (4, [0, 1, 2, 3])
    assert rank0["fsdp"] == (2, [0, 1])
    assert rank0["loss"] == (4, [0, 1, 2, 3])
    assert rank0["hsdp"][0] == 4
    assert results[5]["dp"] == (4, [4, 5, 6, 7])


def _expert_views(kwargs: dict) -> dict[str, tuple[int, list[int]]]:
    dims = ParallelDims(**kwargs).resolve(dist.get_world_size()).build_mesh("cpu")
    views = {}
    for view in ("ep", "efsdp", "fsdp"):
        mesh = dims.mesh_for(view)
        views[view] = (mesh.size(), sorted(dist.get_process_group_ranks(mesh.get_group())))
    views["ehsdp"] = (dims.mesh_for("ehsdp").size(), list(dims.mesh_for("ehsdp").mesh_dim_names or ()))
    return views


def test_expert_views_cut_the_data_ranks_into_ep_groups() -> None:
    # 8 ranks as pp=2 x dp_shard=4, ep=2: each pp stage's 4 data ranks make 2 ep groups of 2 neighbours
    results = run_distributed(_expert_views, 8, {"pp": 2, "dp_shard": 4, "ep": 2})
    assert results[0]["ep"] == (2, [0, 1])
    assert results[0]["efsdp"] == (2, [0, 2])
    assert results[3]["ep"] == (2, [2, 3])
    assert results[3]["efsdp"] == (2, [1, 3])
    assert results[5]["ep"] == (2, [4, 5])
    assert results[5]["efsdp"] == (2, [5, 7])
    assert results[0]["fsdp"] == (4, [0, 1, 2, 3])  # the dense parameters still shard over all 4
    assert results[0]["ehsdp"] == (2, ["dp_replicate", "efsdp"])


def _views_without_ep() -> tuple[bool, str]:
    dims = ParallelDims().resolve(dist.get_world_size()).build_mesh("cpu")
    try:
        dims.mesh_for("ep")
    except KeyError as error:
        return dims.mesh_for("efsdp") is dims.mesh_for("fsdp"), str(error)
    return False, "no error"


def test_without_ep_experts_shard_like_the_rest() -> None:
    same, error = run_distributed(_views_without_ep, 2)[0]
    assert same
    assert "only when ep > 1" in error
