"""Streaming reader: a safetensors checkpoint (HF index + shards, or one ``model.safetensors``) through a mapper.

Reading is planned group by group. Every check that can fail without data (keys against the graph, files present,
headers sound, keys where the index says) runs before the first tensor is read. Then each group's inputs are read
(from whichever shards hold them), handed to the mapper, and dropped; what stays in memory is one group plus
whatever the consumer keeps.

Memory, honestly counted: ``safe_open`` memory-maps the file and ``get_tensor`` returns a view of the mapping, so
pages it touches count in the process RSS for as long as the file is open. Each tensor is therefore copied out
(``clone``), a file is closed as soon as nothing more is needed from it, and all files are closed whenever
``handle_budget_bytes`` were read since the last time: mapped pages never exceed about that budget plus one
tensor. (Reopening costs a header parse, a few milliseconds, which is why files are not closed after every key.)
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor

from .errors import (
    CorruptIndexError,
    CorruptShardError,
    MapperError,
    MissingKeyError,
    MissingShardError,
    format_keys,
)
from .graph import check_coverage
from .mapper import Group, ModelStateMapper

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
DEFAULT_HANDLE_BUDGET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class GroupResult:
    """The outputs of one group, with the files its inputs came from (for error messages)."""

    group: Group
    outputs: dict[str, Tensor]
    files: dict[str, str] = field(default_factory=dict)  # input key -> shard file name

    def origin(self) -> str:
        """``'a', 'b' in model-00001-of-00002.safetensors``: where this group's inputs were read."""
        by_file: dict[str, list[str]] = {}
        for key, name in self.files.items():
            by_file.setdefault(name, []).append(key)
        return "; ".join(f"{format_keys(keys, limit=3)} in {name}" for name, keys in by_file.items())


@dataclass(frozen=True)
class ReadPlan:
    """Groups in reading order, with the bytes each one reads, and the files that will be opened."""

    groups: list[Group]
    input_bytes: list[int]
    files: list[str]

    @property
    def largest_group_bytes(self) -> int:
        return max(self.input_bytes, default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.input_bytes)


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """``key -> (start, end)`` of each tensor's bytes, from the header alone (which safe_open has validated)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header: dict[str, Any] = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return {key: (int(info["data_offsets"][0]), int(info["data_offsets"][1])) for key, info in header.items()}


class _Handles:
    """Open ``safe_open`` handles. A file is closed when nothing more is needed from it, and all are closed
    whenever ``budget`` bytes were read since the last time: the mapped pages we touched stay below that."""

    def __init__(self, directory: Path, remaining: Counter[str], budget: int) -> None:
        self.directory, self.remaining, self.budget = directory, remaining, budget
        self.open: dict[str, Any] = {}
        self.read_since_close = 0

    def read(self, name: str, key: str) -> Tensor:
        handle = self.open.get(name)
        if handle is None:
            handle = self.open[name] = _open(self.directory / name)
        try:
            view = handle.get_tensor(key)
        except SafetensorError as error:
            raise CorruptShardError(
                f"{self.directory / name}: cannot read {key!r}: {error}", path=str(self.directory / name)
            ) from error
        tensor = view.clone()  # own the bytes: the view pins mapped pages of the file (see module docstring)
        del view, handle
        self.read_since_close += tensor.nbytes
        self.remaining[name] -= 1
        if self.remaining[name] <= 0:
            del self.open[name]  # dropping the last reference unmaps the file, and its pages leave our RSS
        if self.read_since_close >= self.budget:
            self.close()
        return tensor

    def close(self) -> None:
        self.open.clear()
        self.read_since_close = 0


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


class CheckpointReader:
    """A safetensors checkpoint directory, read through mappers.

    ``CheckpointReader(d).stream(mapper)`` yields one ``GroupResult`` per group of ``mapper``. Nothing is read
    before the key sets are checked and the needed shards' headers validated.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, handle_budget_bytes: int = DEFAULT_HANDLE_BUDGET_BYTES
    ):
        self.directory = Path(directory)
        self.handle_budget_bytes = handle_budget_bytes
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
        return dict(weight_map)

    def keys(self) -> frozenset[str]:
        return frozenset(self.weight_map)

    def plan(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
    ) -> ReadPlan:
        """Check everything that can be checked without reading a tensor; return the reading order."""
        check_coverage(
            mapper,
            source_keys=self.weight_map,
            target_keys=target_keys,
            source_name=f"checkpoint {self.name}",
            target_name=target_name,
        )
        needed: dict[str, list[str]] = {}
        for key in self.weight_map:  # index order: deterministic, and usually the shards' own order
            needed.setdefault(self.weight_map[key], []).append(key)
        spans: dict[str, tuple[int, int]] = {}
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
            spans.update(_tensor_spans(path))
        file_rank = {name: position for position, name in enumerate(needed)}

        def position(key: str) -> tuple[int, int]:
            return file_rank[self.weight_map[key]], spans[key][0]

        # Groups in the order of their first byte on disk: files are swept mostly front to back.
        groups = sorted(mapper.groups(), key=lambda group: min(map(position, group.inputs)))
        sizes = [sum(spans[key][1] - spans[key][0] for key in group.inputs) for group in groups]
        return ReadPlan(groups=groups, input_bytes=sizes, files=list(needed))

    def stream(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
    ) -> Iterator[GroupResult]:
        """Yield each group's outputs as soon as its inputs are read; inputs are freed before the next group.

        Keep references to a result only as long as needed: whatever the consumer holds stays in memory.
        """
        plan = self.plan(mapper, target_keys=target_keys, target_name=target_name)
        remaining = Counter(self.weight_map[key] for group in plan.groups for key in group.inputs)
        handles = _Handles(self.directory, remaining, self.handle_budget_bytes)
        try:
            for group in plan.groups:
                files = {key: self.weight_map[key] for key in group.inputs}
                inputs = {key: handles.read(files[key], key) for key in group.inputs}
                try:
                    outputs = mapper.consume(inputs)  # empties ``inputs``: the mapper owns them now
                except MapperError as error:
                    origin = GroupResult(group, {}, files).origin()
                    raise MapperError(f"{error} (while mapping {origin})") from error
                if outputs.keys() != set(group.outputs):
                    raise MapperError(
                        f"{mapper!r} returned {format_keys(outputs)} for a group that declares "
                        f"{format_keys(group.outputs)}"
                    )
                result = GroupResult(group, outputs, files)
                del outputs
                yield result
                del result
        finally:
            handles.close()

    def read(self, key: str) -> Tensor:
        """One tensor, copied out of its shard (for inspection and tests)."""
        if key not in self.weight_map:
            raise MissingKeyError(f"{self.name} has no key {key!r}", path=self.name, key=key)
        return _Handles(self.directory, Counter(), 0).read(self.weight_map[key], key)
