"""Streaming reader: a safetensors checkpoint (HF index + shards, or one ``model.safetensors``) through a mapper.

Reading is planned group by group. Every check that can fail without data (keys against the graph, files present,
headers sound, keys where the index says) runs before the first tensor is read. Then each group's inputs are read
(from whichever shards hold them), handed to the mapper, and dropped; what stays in memory is one group plus
whatever the consumer keeps.

Memory, honestly counted: each tensor is read with ``readinto`` straight into a tensor of its own, so nothing
but the tensors themselves counts in the process RSS. (``safe_open``'s ``get_tensor`` would return a view of a
memory map, whose touched pages stay resident as long as the file is open, and need a copy besides; it is used
only to validate each file's header up front, and to read the rare dtypes torch has no name for.)
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from .errors import (
    CorruptIndexError,
    CorruptShardError,
    MissingKeyError,
    MissingShardError,
    format_keys,
)
from .mapper import ModelStateMapper
from .stream import GroupResult, MappedReader, ReadKeys, ReadPlan

__all__ = ["INDEX_NAME", "SINGLE_FILE_NAME", "CheckpointReader", "GroupResult", "ReadPlan", "TensorInfo"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# safetensors' dtype names; those torch lacks in older versions are looked up by name.
_DTYPES = {
    name: getattr(torch, attribute)
    for name, attribute in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "C64": "complex64",
    }.items()
    if hasattr(torch, attribute)
}


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says about one tensor: where it is, its dtype and shape."""

    file: str
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]
    start: int  # byte offsets within the data section, as the header gives them
    end: int
    data_offset: int  # where the data section starts in the file (after the header)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


# A header is JSON of a few KB per thousand tensors; safetensors itself refuses more than 100 MB.
MAX_HEADER_BYTES = 100_000_000
# bytes per element of each safetensors dtype (sub-byte and exotic ones are refused by safe_open already)
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}  # fmt: skip


def _malformed(path: Path, why: str) -> CorruptShardError:
    return CorruptShardError(f"{path} has a malformed safetensors header: {why}", path=str(path))


def _header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's entry in the header, checked before anything is allocated from it: the header's length
    within the file (and 100 MB), each entry a known dtype, a shape of non-negative ints, and data offsets
    inside the file's data section that span exactly ``shape x dtype`` bytes."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _malformed(path, f"the file has {size} bytes, fewer than the 8 of the header's length")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise _malformed(
                path, f"it claims {length} bytes, but the file has {size} (at most 100 MB allowed)"
            )
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _malformed(path, f"not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _malformed(path, f"a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    infos: dict[str, TensorInfo] = {}
    for key, info in header.items():
        infos[key] = _entry(path, key, info, 8 + length, data_size)
    return infos


def _entry(path: Path, key: str, info: Any, data_offset: int, data_size: int) -> TensorInfo:
    if not isinstance(info, dict):
        raise _malformed(path, f"entry {key!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEM_BYTES:
        raise _malformed(path, f"{key!r} has dtype {dtype!r}; known: {', '.join(sorted(_ITEM_BYTES))}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise _malformed(path, f"{key!r} has shape {shape!r}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise _malformed(
            path, f"{key!r} has data_offsets {offsets!r}, outside the {data_size} bytes of the data section"
        )
    elements = 1
    for n in shape:
        elements *= n
    if offsets[1] - offsets[0] != elements * _ITEM_BYTES[dtype]:
        raise _malformed(
            path,
            f"{key!r} spans {offsets[1] - offsets[0]} bytes, but shape {shape} of {dtype} needs "
            f"{elements * _ITEM_BYTES[dtype]}",
        )
    return TensorInfo(path.name, dtype, tuple(shape), offsets[0], offsets[1], data_offset)


class _Files:
    """The open files of a checkpoint. Each tensor is read with ``readinto`` into a tensor of its own; a file is
    closed as soon as nothing more is needed from it (``remaining`` counts the reads still to come per file)."""

    def __init__(self, directory: Path, info: dict[str, TensorInfo], remaining: Counter[str]) -> None:
        self.directory, self.info, self.remaining = directory, info, remaining
        self.open: dict[str, Any] = {}

    def read(self, key: str) -> Tensor:
        entry = self.info[key]
        path = self.directory / entry.file
        dtype = _DTYPES.get(entry.dtype)
        tensor = (
            self._read_into(path, key, entry, dtype) if dtype is not None else self._read_other(path, key)
        )
        self.remaining[entry.file] -= 1
        if self.remaining[entry.file] <= 0 and entry.file in self.open:
            self.open.pop(entry.file).close()
        return tensor

    def _file(self, path: Path) -> Any:
        file = self.open.get(path.name)
        if file is None:
            file = self.open[path.name] = open(path, "rb")  # noqa: SIM115 - closed in read() or close()
        return file

    def _read_into(self, path: Path, key: str, entry: TensorInfo, dtype: torch.dtype) -> Tensor:
        tensor = torch.empty(entry.shape, dtype=dtype)
        if tensor.nbytes != entry.nbytes:
            raise CorruptShardError(
                f"{path}: the header gives {key!r} {entry.nbytes} bytes, but shape {entry.shape} {dtype} needs "
                f"{tensor.nbytes}",
                path=str(path),
            )
        if tensor.nbytes:
            file = self._file(path)
            file.seek(entry.data_offset + entry.start)
            # A writable byte view of the tensor's own storage: the file's bytes land in place, no copy. (Any:
            # numpy's stubs do not declare the buffer protocol.)
            target: Any = tensor.reshape(-1).view(torch.uint8).numpy()
            got = file.readinto(target)
            if got != tensor.nbytes:
                raise CorruptShardError(
                    f"{path}: {key!r} is cut short ({got} of {tensor.nbytes} bytes); the file may be truncated",
                    path=str(path),
                )
        return tensor

    def _read_other(self, path: Path, key: str) -> Tensor:
        try:
            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(key).clone()  # own the bytes, not a view of the memory map
        except SafetensorError as error:
            raise CorruptShardError(f"{path}: cannot read {key!r}: {error}", path=str(path)) from error

    def close(self) -> None:
        for file in self.open.values():
            file.close()
        self.open.clear()


def _open(path: Path, keys: Iterable[str] = ()) -> Any:
    """``safe_open`` with errors that name the file (and the keys expected in it). Opening validates the header
    against the file size, so a truncated shard fails here, before any tensor is read."""
    if not path.is_file():
        raise MissingShardError(f"{path} does not exist", path=str(path))
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as error:
        holds = f" (it should hold {format_keys(keys, limit=3)})" if keys else ""
        raise CorruptShardError(
            f"{path} is not a valid safetensors file{holds}: {error}; it may be truncated or corrupted",
            path=str(path),
        ) from error


class CheckpointReader(MappedReader):
    """A safetensors checkpoint directory, read through mappers.

    ``CheckpointReader(d).stream(mapper)`` yields one ``GroupResult`` per group of ``mapper``. Nothing is read
    before the key sets are checked and the needed shards' headers validated.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._info: dict[str, TensorInfo] | None = None
        index = self.directory / INDEX_NAME
        single = self.directory / SINGLE_FILE_NAME
        if index.is_file():
            self.name = str(index)
            self.weight_map = self._read_index(index)
        elif single.is_file():
            self.name = str(single)
            self.weight_map = dict.fromkeys(_open(single).keys(), SINGLE_FILE_NAME)
        elif not self.directory.is_dir():
            raise MissingShardError(
                f"checkpoint directory {self.directory} does not exist", path=str(directory)
            )
        else:
            raise MissingShardError(
                f"{self.directory} holds neither {INDEX_NAME} nor {SINGLE_FILE_NAME}", path=str(directory)
            )

    @staticmethod
    def _read_index(path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise CorruptIndexError(f"{path} is not a valid index: {error!r}", path=str(path)) from error
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptIndexError(f"{path}: 'weight_map' must map keys to file names", path=str(path))
        outside = sorted({v for v in weight_map.values() if Path(v).name != v or v in ("", ".", "..")})
        if outside:  # a name with a directory part could read files outside the checkpoint
            raise CorruptIndexError(
                f"{path}: 'weight_map' names {format_keys(outside, limit=3)}, which are not file names in "
                f"{path.parent}",
                path=str(path),
            )
        return dict(weight_map)

    def keys(self) -> frozenset[str]:
        return frozenset(self.weight_map)

    def keys_in_order(self) -> list[str]:
        """Every key, in index order: deterministic, and usually the shards' own order."""
        return list(self.weight_map)

    def file_of(self, key: str) -> str:
        """The name of the shard that holds ``key``, as the index gives it."""
        return self.weight_map[key]

    @contextmanager
    def open_for(self, keys: Iterable[str]) -> Iterator[ReadKeys]:
        """The shards holding ``keys``, open: the context gives the function that reads a list of keys into tensors
        of their own, and closes each file once the last of ``keys`` it holds is read."""
        remaining = Counter(self.weight_map[key] for key in keys)
        handles = _Files(self.directory, self.tensor_info(), remaining)
        try:
            yield lambda wanted: {key: handles.read(key) for key in wanted}
        finally:
            handles.close()

    def _stored_keys(self) -> Iterable[str]:
        return self.keys_in_order()

    def _order(self, mapper: ModelStateMapper) -> ReadPlan:
        spans = self.tensor_info()  # checks every shard's header on the way
        file_rank = {name: position for position, name in enumerate(dict.fromkeys(self.weight_map.values()))}
        return ReadPlan.in_order(
            mapper,
            position=lambda key: (file_rank[self.weight_map[key]], spans[key].start),
            nbytes=lambda key: spans[key].nbytes,
            files=file_rank,
        )

    def _file_of(self, key: str) -> str:
        return self.file_of(key)

    def _reading(self, plan: ReadPlan) -> AbstractContextManager[ReadKeys]:
        return self.open_for(key for group in plan.groups for key in group.inputs)

    def tensor_info(self) -> dict[str, TensorInfo]:
        """Dtype, shape and location of every key, from the shards' headers (no tensor is read).

        Checks on the way what can be checked without data: every file the index names exists and is a sound
        safetensors file, and holds the keys the index says it holds.
        """
        if self._info is not None:
            return self._info
        needed: dict[str, list[str]] = {}
        for key in self.weight_map:  # index order: deterministic, and usually the shards' own order
            needed.setdefault(self.weight_map[key], []).append(key)
        info: dict[str, TensorInfo] = {}
        for name, keys in needed.items():
            path = self.directory / name
            if not path.is_file():
                raise MissingShardError(
                    f"{self.name} maps {len(keys)} keys ({format_keys(keys, limit=3)}) to {name}, "
                    f"which does not exist in {self.directory}",
                    path=str(path),
                )
            handle = _open(path, keys)
            present = set(handle.keys())
            del handle
            for key in keys:
                if key not in present:
                    raise MissingKeyError(
                        f"{self.name} maps key {key!r} to {name}, but {path} does not contain it",
                        path=str(path),
                        key=key,
                    )
            header = _header(path)
            info.update((key, header[key]) for key in keys)
        self._info = info
        return info

    def read(self, key: str) -> Tensor:
        """One tensor, copied out of its shard (for inspection and tests)."""
        if key not in self.weight_map:
            raise MissingKeyError(f"{self.name} has no key {key!r}", path=self.name, key=key)
        name = self.weight_map[key]
        header = _header(self.directory / name) if key not in (self._info or {}) else self.tensor_info()
        if key not in header:
            path = self.directory / name
            raise MissingKeyError(
                f"{self.name} maps key {key!r} to {name}, but {path} does not contain it",
                path=str(path),
                key=key,
            )
        files = _Files(self.directory, {key: header[key]}, Counter())
        try:
            return files.read(key)
        finally:
            files.close()
