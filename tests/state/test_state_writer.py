"""The sharded writer: shard sizes, the index, names, and atomicity."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from state_helpers import assert_same_state, read_checkpoint

from lightning_d9d.state import INDEX_NAME, CheckpointFileError, ShardedWriter


def tensors(count: int, numel: int = 100) -> dict[str, torch.Tensor]:
    # 400 bytes each in fp32
    return {f"layer.{i}.weight": torch.randn(numel) for i in range(count)}


def write(directory: Path, state: dict[str, torch.Tensor], **kwargs: int) -> None:
    with ShardedWriter(directory, **kwargs) as writer:
        for key, tensor in state.items():
            writer.add(key, tensor)


def test_shards_by_size_with_a_correct_index(tmp_path: Path) -> None:
    state = tensors(10)  # 10 x 400 bytes
    write(tmp_path / "ckpt", state, max_shard_bytes=1000)  # two tensors per shard
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [f"model-{n:05d}-of-00005.safetensors" for n in range(1, 6)] + [INDEX_NAME]
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 4000
    assert sorted(index["weight_map"]) == sorted(state)
    for key, name in index["weight_map"].items():
        with safe_open(str(tmp_path / "ckpt" / name), framework="pt") as handle:
            assert key in handle.keys()  # noqa: SIM118 - safe_open is not a Mapping
            assert handle.metadata() == {"format": "pt"}
    for name in names[:-1]:
        with safe_open(str(tmp_path / "ckpt" / name), framework="pt") as handle:
            assert sum(handle.get_tensor(k).nbytes for k in handle.keys()) <= 1000  # noqa: SIM118
    assert_same_state(read_checkpoint(tmp_path / "ckpt"), state)


def test_oversized_tensor_gets_its_own_shard_and_views_are_compacted(tmp_path: Path) -> None:
    big = torch.randn(4, 100)
    state = {
        "small": torch.randn(10),
        "big": torch.randn(1000),  # larger than a shard on its own
        "row": big[1],  # a view of a larger tensor: written compactly
        "col": big[:, 3],  # non-contiguous
        "tied": big,
        "tied_again": big,  # the same tensor under two keys (tied weights)
    }
    write(tmp_path / "ckpt", state, max_shard_bytes=2000)
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())["weight_map"]
    assert index["big"] not in {index["small"], index["row"]}
    assert_same_state(read_checkpoint(tmp_path / "ckpt"), {k: v.contiguous() for k, v in state.items()})


def test_one_shard_is_model_safetensors_without_index(tmp_path: Path) -> None:
    state = tensors(3)
    write(tmp_path / "ckpt", state)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["model.safetensors"]
    assert_same_state(read_checkpoint(tmp_path / "ckpt"), state)
    write(tmp_path / "empty", {})
    assert read_checkpoint(tmp_path / "empty") == {}


class Boom(RuntimeError):
    pass


def failing_source(state: dict[str, torch.Tensor], after: int) -> Iterator[tuple[str, torch.Tensor]]:
    for position, item in enumerate(state.items()):
        if position == after:
            raise Boom("the tensor source failed midway")
        yield item


def test_failure_midway_leaves_no_directory(tmp_path: Path) -> None:
    with pytest.raises(Boom), ShardedWriter(tmp_path / "ckpt", max_shard_bytes=500) as writer:
        for key, tensor in failing_source(tensors(10), after=6):  # some shards are already on disk by then
            writer.add(key, tensor)
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor the hidden temporary directory


def test_failure_midway_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    old = tensors(4)
    write(tmp_path / "ckpt", old, max_shard_bytes=500)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(Boom), ShardedWriter(tmp_path / "ckpt", max_shard_bytes=500) as writer:
        for key, tensor in failing_source(tensors(10), after=6):
            writer.add(key, tensor)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    assert_same_state(read_checkpoint(tmp_path / "ckpt"), old)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]

    new = tensors(2)
    write(tmp_path / "ckpt", new)  # a successful write replaces it completely
    assert_same_state(read_checkpoint(tmp_path / "ckpt"), new)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointFileError, match="refusing to replace"):
        write(tmp_path / "home", tensors(1))
    assert (tmp_path / "home" / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_writer_rejects_duplicate_keys_and_dtensors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="written twice"), ShardedWriter(tmp_path / "ckpt") as writer:
        writer.add("a", torch.zeros(1))
        writer.add("a", torch.zeros(1))
    assert list(tmp_path.iterdir()) == []


def test_a_write_cleans_up_after_crashed_writes_of_the_same_directory(tmp_path: Path) -> None:
    (tmp_path / ".ckpt.tmp-0badf00d").mkdir()  # a write that crashed midway
    (tmp_path / ".ckpt.tmp-0badf00d" / "part-00000-00000.safetensors").write_bytes(b"half")
    (tmp_path / ".other.tmp-0badf00d").mkdir()  # another directory's: left alone
    write(tmp_path / "ckpt", tensors(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-0badf00d", "ckpt"]
