"""The model state of a ``torch.distributed.checkpoint`` (DCP) directory, read in one process, group by group.

A training checkpoint of the d9d strategy is a DCP directory (``.metadata`` plus one ``.distcp`` file per rank)
holding ``{"state_dict": ..., "optimizer_0": ...}``. ``DCPReader`` streams its model tensors through a mapper,
like ``CheckpointReader`` does for safetensors: no process group, no GPU, and only one group in memory at a
time. Each group is one ``dcp.load`` into freshly allocated full tensors, and DCP assembles them from the ranks'
shards, so the mesh the checkpoint was written on does not matter.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import (
    CheckpointError,
    CorruptIndexError,
    CorruptShardError,
    MapperError,
    MissingShardError,
    format_keys,
)
from .graph import check_coverage
from .mapper import ModelStateMapper
from .reader import GroupResult, ReadPlan

DCP_METADATA_NAME = ".metadata"


def _metadata_reader(directory: Path) -> Any:
    """A ``FileSystemReader`` that reads ``.metadata`` once: ``dcp.load`` asks for it on every call, and a
    checkpoint with optimizer state has a metadata entry per tensor and per state."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Cached(FileSystemReader):
        _cached: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._cached is None:
                self._cached = super().read_metadata(*args, **kwargs)
            return self._cached

    return _Cached(str(directory))


class DCPReader:
    """The tensors under ``section`` (default ``"state_dict"``) of a DCP checkpoint, keys relative to ``prefix``.

    ``DCPReader(d, prefix="model.").stream(mapper)`` yields one ``GroupResult`` per group of ``mapper``, reading
    only the keys the mapper reads. Keys outside ``prefix`` are not part of this reader.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, section: str = "state_dict", prefix: str = ""
    ) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        self.section, self.prefix = section, prefix
        self.name = str(self.directory / DCP_METADATA_NAME)
        if not self.directory.is_dir():
            raise MissingShardError(
                f"checkpoint directory {self.directory} does not exist", path=str(directory)
            )
        if not (self.directory / DCP_METADATA_NAME).is_file():
            raise MissingShardError(
                f"{self.directory} is not a torch.distributed.checkpoint directory: it has no {DCP_METADATA_NAME}",
                path=self.name,
            )
        self._storage = _metadata_reader(self.directory)
        try:
            metadata = self._storage.read_metadata()
        except Exception as error:  # a pickle of DCP classes: anything can go wrong in a damaged file
            raise CorruptIndexError(f"{self.name} cannot be read: {error!r}", path=self.name) from error
        self._files = sorted({info.relative_path for info in metadata.storage_data.values()})
        paths = metadata.planner_data or {}
        # Every tensor of the section by its full key; then the ones under ``prefix``, by their key without it.
        self._section: dict[str, tuple[str, TensorStorageMetadata]] = {}
        self.sections: set[str] = set()
        for flat, entry in metadata.state_dict_metadata.items():
            path = paths.get(flat)
            if path and len(path) == 2:  # ("state_dict", "model.layers.0...."): the module key is one segment
                top, key = str(path[0]), str(path[1])
            else:
                top, _, key = flat.partition(".")
            self.sections.add(top)
            if top == section and isinstance(entry, TensorStorageMetadata):
                self._section[key] = (flat, entry)
        if section not in self.sections:
            raise CheckpointError(
                f"{self.name} holds no {section!r} entries (it holds {format_keys(self.sections)}): not a "
                "checkpoint of a LightningModule?"
            )
        self._entries = {
            key[len(prefix) :]: value for key, value in self._section.items() if key.startswith(prefix)
        }

    def with_prefix(self, prefix: str) -> DCPReader:
        """The same checkpoint, keys relative to another prefix (the metadata is not read again)."""
        other = object.__new__(DCPReader)
        other.__dict__.update(self.__dict__)
        other.prefix = prefix
        other._entries = {
            key[len(prefix) :]: value for key, value in self._section.items() if key.startswith(prefix)
        }
        return other

    def all_keys(self) -> frozenset[str]:
        """Every tensor key of the section, with its full name (before ``prefix`` is taken off)."""
        return frozenset(self._section)

    def keys(self) -> frozenset[str]:
        return frozenset(self._entries)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(entry.size) for key, (_, entry) in self._entries.items()}

    def dtypes(self) -> dict[str, torch.dtype]:
        return {key: entry.properties.dtype for key, (_, entry) in self._entries.items()}

    def _nbytes(self, key: str) -> int:
        _, entry = self._entries[key]
        return entry.size.numel() * entry.properties.dtype.itemsize

    def plan(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
        ignore: Iterable[str] = (),
    ) -> ReadPlan:
        """Check the keys against the graph (``ignore``: keys present but deliberately not read, such as tied
        aliases); return the groups in checkpoint order."""
        skipped = set(ignore)
        check_coverage(
            mapper,
            source_keys=[key for key in self._entries if key not in skipped],
            target_keys=target_keys,
            source_name=f"checkpoint {self.name}" + (f" (under {self.prefix!r})" if self.prefix else ""),
            target_name=target_name,
        )
        order = {key: position for position, key in enumerate(self._entries)}
        plan = ReadPlan.in_order(mapper, position=order.__getitem__, nbytes=self._nbytes, files=self._files)
        self._check_files({key for group in plan.groups for key in group.inputs})
        return plan

    def read(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """Full tensors of ``keys``, assembled from every rank's shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        keys = list(keys)
        missing = [key for key in keys if key not in self._entries]
        if missing:
            raise CheckpointError(f"{self.name} has no keys {format_keys(missing)}")
        buffers = {}
        for key in keys:
            flat, entry = self._entries[key]
            buffers[flat] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        try:
            with warnings.catch_warnings():
                # dcp.load announces that it runs without a process group, which is the point here.
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to load in a single process"
                )
                dcp.load(buffers, storage_reader=self._storage, no_dist=True)
        # DCP wraps the failures of the ranks in its own type, a BaseException.
        except (Exception, CheckpointException) as error:
            # Its message carries whole tracebacks: the last line says what went wrong.
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = lines[-1] if lines else type(error).__name__
            files = sorted({name for key in keys for name in self._files_of(self._entries[key][0])})
            where = ", ".join(str(self.directory / name) for name in files) or str(self.directory)
            raise CorruptShardError(
                f"{where}: cannot read {format_keys([self.prefix + key for key in keys], limit=3)} ({reason}); "
                "a .distcp file may be truncated or missing",
                path=str(self.directory / files[0]) if files else str(self.directory),
            ) from error
        return {key: buffers.pop(self._entries[key][0]) for key in keys}

    def _check_files(self, keys: set[str]) -> None:
        """Every chunk of ``keys`` lies within an existing file: a missing or truncated ``.distcp`` file fails
        here, naming file and key, before any tensor is read."""
        wanted = {self._entries[key][0]: key for key in keys}
        sizes: dict[str, int] = {}
        for index, info in self._storage.read_metadata().storage_data.items():
            key = wanted.get(index.fqn)
            if key is None:
                continue
            path = self.directory / info.relative_path
            if info.relative_path not in sizes:
                sizes[info.relative_path] = path.stat().st_size if path.is_file() else -1
            size = sizes[info.relative_path]
            if size < 0:
                raise MissingShardError(
                    f"{self.name} stores {self.prefix + key!r} in {path}, which does not exist",
                    path=str(path),
                )
            if size < info.offset + info.length:
                raise CorruptShardError(
                    f"{path} is truncated: it has {size} bytes, but {self.prefix + key!r} is stored up to byte "
                    f"{info.offset + info.length}",
                    path=str(path),
                )

    def _files_of(self, flat: str) -> set[str]:
        """The ``.distcp`` files holding chunks of the entry ``flat`` (one per rank that had a shard of it)."""
        metadata = self._storage.read_metadata()
        return {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == flat}

    def stream(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
        ignore: Iterable[str] = (),
    ) -> Iterator[GroupResult]:
        """Yield each group's outputs as soon as its inputs are read; inputs are freed before the next group."""
        plan = self.plan(mapper, target_keys=target_keys, target_name=target_name, ignore=ignore)
        where = self.directory.name or str(self.directory)
        for group in plan.groups:
            files = dict.fromkeys(group.inputs, where)
            inputs = self.read(group.inputs)
            try:
                outputs = mapper.consume(inputs)
            except MapperError as error:
                raise MapperError(
                    f"{error} (while mapping {GroupResult(group, {}, files).origin()})"
                ) from error
            result = GroupResult(group, outputs, files)
            del outputs
            yield result
            del result
