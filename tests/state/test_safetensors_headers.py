"""Untrusted safetensors input: a malformed header or index is a named error before anything is allocated
from it (huge lengths, offsets outside the file, unknown dtypes, shapes that do not fit their bytes, paths
out of the checkpoint)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lightning_d9d.state import INDEX_NAME, CheckpointReader, CorruptIndexError, CorruptShardError

SHARD = "model-00001-of-00001.safetensors"


def checkpoint(
    directory: Path, header_edit: Callable[[dict[str, Any]], Any] | None = None, **raw: Any
) -> Path:
    """A one-shard checkpoint with an index; ``header_edit`` rewrites the shard's parsed header, ``raw`` its
    bytes (``length``: the 8-byte length field, ``data``: the bytes after the header)."""
    directory.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(directory / SHARD))
    content = (directory / SHARD).read_bytes()
    (length,) = struct.unpack("<Q", content[:8])
    header, data = json.loads(content[8 : 8 + length]), content[8 + length :]
    if header_edit is not None:
        header = header_edit(header) or header
    encoded = json.dumps(header).encode() if not isinstance(header, bytes) else header
    length_field = struct.pack("<Q", raw.get("length", len(encoded)))
    (directory / SHARD).write_bytes(length_field + encoded + raw.get("data", data))
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": SHARD}}))
    return directory


def read_fails(directory: Path, match: str) -> None:
    with pytest.raises(CorruptShardError, match=match) as caught:
        CheckpointReader(directory).read("w")
    assert str(directory / SHARD) in str(caught.value)


def test_a_sound_file_reads(tmp_path: Path) -> None:
    assert torch.equal(
        CheckpointReader(checkpoint(tmp_path / "c")).read("w"), torch.arange(6.0).reshape(2, 3)
    )


def test_a_huge_header_length_is_refused_before_reading_it(tmp_path: Path) -> None:
    read_fails(checkpoint(tmp_path / "c", length=2**62), "claims 4611686018427387904 bytes")


def test_offsets_outside_the_file_are_refused(tmp_path: Path) -> None:
    def far(header: dict) -> None:
        header["w"]["data_offsets"] = [0, 10**12]

    read_fails(checkpoint(tmp_path / "c", far), "outside the 24 bytes of the data section")


def test_an_unknown_dtype_is_refused(tmp_path: Path) -> None:
    def odd(header: dict) -> None:
        header["w"]["dtype"] = "F128"

    read_fails(checkpoint(tmp_path / "c", odd), "dtype 'F128'")


def test_a_shape_that_does_not_fit_its_bytes_is_refused(tmp_path: Path) -> None:
    def huge(header: dict) -> None:
        header["w"]["shape"] = [10**9, 10**9]

    read_fails(checkpoint(tmp_path / "c", huge), "needs 4000000000000000000")

    def negative(header: dict) -> None:
        header["w"]["shape"] = [-2, -3]

    read_fails(checkpoint(tmp_path / "d", negative), "not a list of non-negative integers")


def test_a_header_that_is_not_json_or_a_file_too_short_is_refused(tmp_path: Path) -> None:
    read_fails(checkpoint(tmp_path / "c", lambda header: b"{not json"), "not JSON")
    short = checkpoint(tmp_path / "d")
    (short / SHARD).write_bytes(b"\x01\x02")
    read_fails(short, "fewer than the 8")


def test_an_index_naming_files_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    directory = checkpoint(tmp_path / "c")
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    with pytest.raises(CorruptIndexError, match="not file names"):
        CheckpointReader(directory)
