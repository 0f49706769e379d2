"""Each way a checkpoint can be wrong, and that the error names the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from state_helpers import TinyConfig, TinyModel, disk_state, tiny_mapper, write_checkpoint

from lightning_d9d.state import (
    INDEX_NAME,
    CheckpointError,
    CorruptIndexError,
    CorruptShardError,
    KeyCoverageError,
    MapperError,
    MissingKeyError,
    MissingShardError,
    ShapeMismatchError,
    load_into_module,
)

CFG = TinyConfig()
KEY = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path / "ckpt", disk_state(CFG), files=3)
    return tmp_path / "ckpt"


def weight_map(directory: Path) -> dict[str, str]:
    return dict(json.loads((directory / INDEX_NAME).read_text())["weight_map"])


def rewrite_index(directory: Path, mapping: dict[str, str]) -> None:
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": mapping}))


def load(directory: Path, module_cfg: TinyConfig = CFG) -> None:
    load_into_module(TinyModel(module_cfg).to(torch.bfloat16), directory, tiny_mapper(CFG))


def test_missing_shard_file(checkpoint: Path) -> None:
    shard = weight_map(checkpoint)[KEY]
    (checkpoint / shard).unlink()
    with pytest.raises(MissingShardError) as raised:
        load(checkpoint)
    assert shard in str(raised.value) and INDEX_NAME in str(raised.value)
    assert "model.layers" in str(raised.value)  # names (some of) the keys it should hold
    assert raised.value.path.endswith(shard)


def test_truncated_shard_is_caught_at_open_time(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = weight_map(checkpoint)[KEY]
    data = (checkpoint / shard).read_bytes()
    (checkpoint / shard).write_bytes(data[:-7])
    with pytest.raises(CorruptShardError) as raised:
        load(checkpoint)
    message = str(raised.value)
    assert shard in message and "truncated" in message
    held = [key for key, name in weight_map(checkpoint).items() if name == shard]
    assert any(repr(key) in message for key in held)
    # A garbage header, too.
    (checkpoint / shard).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CorruptShardError, match=shard):
        load(checkpoint)


def test_key_missing_from_index(checkpoint: Path) -> None:
    mapping = weight_map(checkpoint)
    del mapping[KEY]
    rewrite_index(checkpoint, mapping)
    with pytest.raises(KeyCoverageError) as raised:
        load(checkpoint)
    assert repr(KEY) in str(raised.value) and INDEX_NAME in str(raised.value)
    assert raised.value.missing_source == [KEY]


def test_index_points_to_a_shard_without_the_key(checkpoint: Path) -> None:
    mapping = weight_map(checkpoint)
    wrong = next(name for name in set(mapping.values()) if name != mapping[KEY])
    mapping[KEY] = wrong
    rewrite_index(checkpoint, mapping)
    with pytest.raises(MissingKeyError) as raised:
        load(checkpoint)
    assert repr(KEY) in str(raised.value) and wrong in str(raised.value)


def test_corrupt_index(checkpoint: Path) -> None:
    (checkpoint / INDEX_NAME).write_text("{ not json")
    with pytest.raises(CorruptIndexError, match=INDEX_NAME):
        load(checkpoint)
    (checkpoint / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CorruptIndexError, match="weight_map"):
        load(checkpoint)


def test_shape_mismatch_names_key_file_and_shapes(checkpoint: Path) -> None:
    with pytest.raises(ShapeMismatchError) as raised:
        load(checkpoint, TinyConfig(vocab=9))  # a larger embedding in the module than in the file
    message = str(raised.value)
    assert raised.value.key == "embed.weight"
    assert "'embed.weight'" in message
    assert "expects shape (9, 6)" in message and "gives (7, 6)" in message
    file = weight_map(checkpoint)["model.embed_tokens.weight"]
    assert f"'model.embed_tokens.weight' in {file}" in message


def test_mapper_errors_name_the_files_read(checkpoint: Path) -> None:
    # The mapper expects a wider q projection than the file has: Concat fails, naming the group's files.
    with pytest.raises(MapperError) as raised:
        load_into_module(TinyModel(CFG).to(torch.bfloat16), checkpoint, tiny_mapper(TinyConfig(heads=4)))
    message = str(raised.value)
    assert "expected sizes (8, 2, 2)" in message and "q_proj.weight' in model-0000" in message


def test_dtype_mismatch(checkpoint: Path) -> None:
    with pytest.raises(ShapeMismatchError, match=r"torch\.float32.*torch\.bfloat16.*Cast"):
        load_into_module(TinyModel(CFG), checkpoint, tiny_mapper(CFG))


def test_checkpoint_of_another_model(tmp_path: Path) -> None:
    other = {"transformer.h.0.attn.c_attn.weight": torch.zeros(2), "transformer.wte.weight": torch.zeros(2)}
    write_checkpoint(tmp_path / "gpt2", other, files=1)
    with pytest.raises(KeyCoverageError) as raised:
        load(tmp_path / "gpt2")
    message = str(raised.value)
    assert "'transformer.wte.weight'" in message and "not read by the mapper" in message
    assert "'model.embed_tokens.weight'" in message and "missing from checkpoint" in message
    assert str(tmp_path / "gpt2" / INDEX_NAME) in message


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    with pytest.raises(MissingShardError, match="does not exist"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingShardError, match=INDEX_NAME):
        load(tmp_path / "empty")


def test_errors_are_value_errors() -> None:
    assert issubclass(CheckpointError, ValueError)
    for kind in (MissingShardError, CorruptShardError, MissingKeyError, ShapeMismatchError, KeyCoverageError):
        assert issubclass(kind, CheckpointError)
