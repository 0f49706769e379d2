"""The model state of a ``torch.distributed.checkpoint`` (DCP) directory, read in one process, group by group.

A training checkpoint of the d9d strategy (its format: ``training.py``) is a DCP directory (``.metadata`` plus
``.distcp`` files) holding ``{"state_dict": ..., "optimizer_0": ...}``. ``DCPReader`` streams its model tensors through a mapper,
like ``CheckpointReader`` does for safetensors: no process group, no GPU, and only one group in memory at a
time. Each group is one ``dcp.load`` into freshly allocated full tensors, and DCP assembles them from the ranks'
shards, so the mesh the checkpoint was written on does not matter.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import CheckpointError, CorruptShardError, MissingShardError, format_keys
from .mapper import ModelStateMapper
from .stream import MappedReader, ReadKeys, ReadPlan
from .training import DCP_METADATA_NAME, MODEL_SECTION, check_chunks, dcp_failure_reason, read_dcp_metadata
from .untrusted import RestrictedLoadPlanner


def _metadata_reader(directory: Path, metadata: Any) -> Any:
    """A ``FileSystemReader`` that reads ``.metadata`` only once (here, already read): ``dcp.load`` asks for it
    on every call, and a checkpoint with optimizer state has a metadata entry per tensor and per state."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Cached(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    return _Cached(str(directory))


class DCPReader(MappedReader):
    """The tensors under ``section`` (default ``"state_dict"``) of a DCP checkpoint, keys relative to ``prefix``.

    ``DCPReader(d, prefix="model.").stream(mapper)`` yields one ``GroupResult`` per group of ``mapper``, reading
    only the keys the mapper reads. Keys outside ``prefix`` are not part of this reader.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, section: str = MODEL_SECTION, prefix: str = ""
    ) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        self.section, self.prefix = section, prefix
        self.name = str(self.directory / DCP_METADATA_NAME)
        if not self.directory.is_dir():
            raise MissingShardError(
                f"checkpoint directory {self.directory} does not exist", path=str(directory)
            )
        metadata = read_dcp_metadata(self.directory)
        self._storage = _metadata_reader(self.directory, metadata)
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

    def keys_in_order(self) -> list[str]:
        """Every key under the prefix (without it), in the order ``.metadata`` lists them."""
        return list(self._entries)

    def source_name(self) -> str:
        """How messages name this checkpoint: its ``.metadata`` file, and the prefix where there is one."""
        return f"checkpoint {self.name}" + (f" (under {self.prefix!r})" if self.prefix else "")

    def file_of(self, key: str) -> str:
        """Where messages say ``key`` is read from: the checkpoint directory (DCP assembles a tensor from the
        ``.distcp`` files of every rank that held a shard of it)."""
        return self.directory.name or str(self.directory)

    def _stored_keys(self) -> Iterable[str]:
        return self.keys_in_order()

    def _source_name(self) -> str:
        return self.source_name()

    def _order(self, mapper: ModelStateMapper) -> ReadPlan:
        order = {key: position for position, key in enumerate(self._entries)}
        plan = ReadPlan.in_order(mapper, position=order.__getitem__, nbytes=self._nbytes, files=self._files)
        self._check({key for group in plan.groups for key in group.inputs})  # before the first tensor is read
        return plan

    def _check(self, keys: Iterable[str]) -> None:
        """``.metadata``'s chunks of ``keys`` tile their tensors and lie within the files (``check_chunks``)."""
        names = {self._entries[key][0]: self.prefix + key for key in keys}
        check_chunks(self.directory, self._storage.read_metadata(), names)

    def _file_of(self, key: str) -> str:
        return self.file_of(key)

    def _reading(self, plan: ReadPlan) -> nullcontext[ReadKeys]:
        return nullcontext(self.read)

    def read(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """Full tensors of ``keys``, assembled from every rank's shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        keys = list(keys)
        missing = [key for key in keys if key not in self._entries]
        if missing:
            raise CheckpointError(f"{self.name} has no keys {format_keys(missing)}")
        self._check(keys)  # what is allocated next is what .metadata declares: only once it holds up
        buffers = {}
        for key in keys:
            flat, entry = self._entries[key]
            # zeros, not empty: were a part never read, it would hold no bytes of this process's memory
            buffers[flat] = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        try:
            with warnings.catch_warnings():
                # dcp.load announces that it runs without a process group, which is the point here.
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to load in a single process"
                )
                # tensors only, but a planner that would unpickle nothing else either
                planner = RestrictedLoadPlanner(self.directory)
                dcp.load(buffers, storage_reader=self._storage, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as error:  # DCP wraps the ranks' failures in a BaseException
            reason = dcp_failure_reason(error)
            files = sorted({name for key in keys for name in self._files_of(self._entries[key][0])})
            where = ", ".join(str(self.directory / name) for name in files) or str(self.directory)
            raise CorruptShardError(
                f"{where}: cannot read {format_keys([self.prefix + key for key in keys], limit=3)} ({reason}); "
                "a .distcp file may be truncated or missing",
                path=str(self.directory / files[0]) if files else str(self.directory),
            ) from error
        return {key: buffers.pop(self._entries[key][0]) for key in keys}

    def _files_of(self, flat: str) -> set[str]:
        """The ``.distcp`` files holding chunks of the entry ``flat`` (one per rank that had a shard of it)."""
        metadata = self._storage.read_metadata()
        return {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == flat}
