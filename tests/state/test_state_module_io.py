"""Checkpoint → module → checkpoint through a graph whose two layouts differ; the key check before any read."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
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

import lightning_d9d.state.reader as reader_module
from lightning_d9d.state import (
    CheckpointReader,
    Drop,
    Identity,
    KeyCoverageError,
    Parallel,
    Rename,
    convert,
    load_into_module,
    save_from_module,
)

CFG = TinyConfig()


def tiny_model() -> TinyModel:
    torch.manual_seed(1)
    return TinyModel(CFG).to(torch.bfloat16)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    disk = disk_state(CFG)
    write_checkpoint(tmp_path / "hf", disk, files=3)
    return tmp_path / "hf", disk


def test_load_then_export_is_exact(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    directory, disk = checkpoint
    model = tiny_model()
    load_into_module(model, directory, tiny_mapper(CFG))
    assert_same_state(dict(model.state_dict()), module_state(CFG, disk))

    out = tmp_path / "export"
    save_from_module(model, out, tiny_mapper(CFG).inverse(), max_shard_bytes=300)
    assert (out / "model.safetensors.index.json").exists()
    assert_same_state(read_checkpoint(out), disk)  # same keys, dtypes, shapes and bytes as the original file


def test_single_file_checkpoint(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    directory, disk = checkpoint
    model = tiny_model()
    load_into_module(model, directory, tiny_mapper(CFG))
    single = tmp_path / "single"
    save_from_module(model, single, tiny_mapper(CFG).inverse())  # default shard size: one file, no index
    assert sorted(p.name for p in single.iterdir()) == ["model.safetensors"]
    fresh = TinyModel(CFG).to(torch.bfloat16)
    load_into_module(fresh, single, tiny_mapper(CFG))
    assert_same_state(dict(fresh.state_dict()), module_state(CFG, disk))


def test_convert_disk_to_disk_and_back(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    directory, disk = checkpoint
    mapper = tiny_mapper(CFG)
    convert(directory, tmp_path / "module_layout", mapper, max_shard_bytes=200)
    assert_same_state(read_checkpoint(tmp_path / "module_layout"), module_state(CFG, disk))
    convert(tmp_path / "module_layout", tmp_path / "back", mapper.inverse(), max_shard_bytes=10_000)
    assert_same_state(read_checkpoint(tmp_path / "back"), disk)
    # In place: everything is read before the new directory replaces the old one.
    convert(tmp_path / "back", tmp_path / "back", mapper, max_shard_bytes=200)
    assert_same_state(read_checkpoint(tmp_path / "back"), module_state(CFG, disk))


def test_reader_plan_orders_groups_and_counts_bytes(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory, disk = checkpoint
    plan = CheckpointReader(directory).plan(tiny_mapper(CFG))
    assert plan.total_bytes == sum(t.nbytes for t in disk.values())
    expert_group = CFG.experts * CFG.ffn * CFG.dim * 2  # bf16
    assert plan.largest_group_bytes == expert_group
    assert len(plan.files) == 3


def test_every_dtype_reads_back_exactly(tmp_path: Path) -> None:
    """Tensors are read straight into their own storage: every dtype, odd sizes, 0-d and empty tensors."""
    state = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 1).to(torch.float16),
        "i64": torch.arange(-4, 5),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    write_checkpoint(tmp_path / "mixed", state, files=2)
    reader = CheckpointReader(tmp_path / "mixed")
    read = {result.group.inputs[0]: result.outputs for result in reader.stream(Identity(state))}
    assert_same_state({key: outputs[key] for key, outputs in read.items()}, state)
    assert_same_state({key: reader.read(key) for key in state}, state)


class _NoOpen:
    """Stands in for ``safe_open`` and fails the test if anything tries to open a file."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(path)
        raise AssertionError(f"opened {path} before the key check")


def test_key_mismatch_reported_by_name_before_any_file_is_opened(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, _ = checkpoint
    spy = _NoOpen()
    monkeypatch.setattr(reader_module, "safe_open", spy)
    # The mapper reads a key the file does not have, and writes one the module does not have.
    mapper = Parallel([tiny_mapper(CFG), Rename({"model.rotary.inv_freq": "rotary"})])
    with pytest.raises(KeyCoverageError) as raised:
        load_into_module(tiny_model(), directory, mapper)
    message = str(raised.value)
    assert "'model.rotary.inv_freq'" in message and "missing from checkpoint" in message
    assert "'rotary'" in message and "not expected by TinyModel" in message
    assert "model.safetensors.index.json" in message
    assert raised.value.missing_source == ["model.rotary.inv_freq"]
    assert raised.value.unexpected_target == ["rotary"]
    assert spy.calls == []

    # Extra keys in the file are named too (and ``Drop`` is the way to accept them).
    with pytest.raises(KeyCoverageError, match=re.escape("'model.scale'")):
        load_into_module(tiny_model(), directory, _without(tiny_mapper(CFG), "model.scale"))
    assert spy.calls == []


def _without(mapper: Any, key: str) -> Any:
    # The tiny mapper minus the group that reads ``key`` (the file's extra key then has no reader).
    from lightning_d9d.state import ModelStateMapper

    class Without(ModelStateMapper):
        def groups(self) -> list[Any]:
            return [g for g in mapper.groups() if key not in g.inputs]

        def apply(self, inputs: Any) -> dict[str, torch.Tensor]:
            return mapper.apply(inputs)

    return Without()


def test_key_check_still_wins_when_data_files_are_gone(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    directory, _ = checkpoint
    for shard in directory.glob("*.safetensors"):
        shard.unlink()
    mapper = Parallel([tiny_mapper(CFG), Drop(["model.not_there"])])
    with pytest.raises(KeyCoverageError, match=re.escape("'model.not_there'")):
        load_into_module(tiny_model(), directory, mapper)


def test_dropped_keys_are_read_and_ignored(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    _, disk = checkpoint
    extra = dict(disk, **{"model.rotary.inv_freq": torch.arange(3.0)})
    write_checkpoint(tmp_path / "extra", extra, files=2)
    model = tiny_model()
    load_into_module(model, tmp_path / "extra", Parallel([tiny_mapper(CFG), Drop(["model.rotary.inv_freq"])]))
    assert_same_state(dict(model.state_dict()), module_state(CFG, disk))
