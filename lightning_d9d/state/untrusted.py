"""Reading a DCP checkpoint without unpickling arbitrary objects.

Two places in ``torch.distributed.checkpoint`` unpickle what a file holds, and a crafted checkpoint could run
code through either:

- ``FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``. :class:`RestrictedFileSystemReader`
  unpickles it with an allow-list (DCP's metadata classes, ``torch.Size``, dtypes, paths) and refuses anything
  else, naming the file and the object. What it built is then checked field by field: the classes are DCP's,
  but a pickle fills their fields with anything, and DCP's reader opens ``directory / relative_path`` as given
  (an absolute path, or ``..``, reads outside the checkpoint the manifest vouches for).
- ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry (the optimizer's ``param_groups`` fields: lr,
  betas, ...) with ``torch.load(weights_only=False)``. :class:`RestrictedLoadPlanner` reads them with
  ``weights_only=True`` (plain types: numbers, strings, None, tuples, lists, dicts, tensors) and refuses
  anything else, naming the checkpoint and the entry.

Tensor bytes DCP itself reads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import inspect
import io
import pickle
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from .boxes import BoxedLoadPlanner
from .errors import CorruptIndexError
from .manifest import is_file_name
from .selection import DCP_METADATA_NAME

# (module, name) pairs a .metadata may name besides the classes of torch.distributed.checkpoint.metadata
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's layout object
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if inspect.isclass(found) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CorruptIndexError(
            f"{self.path} names {module}.{name}, which a DCP checkpoint's metadata never holds: refusing to "
            "unpickle it (the file may be crafted). Load only checkpoints you trust",
            path=str(self.path),
        )


def read_metadata(path: Path) -> Metadata:
    """DCP's ``Metadata`` from the file ``path`` through the allow-list."""
    with open(path, "rb") as file:
        metadata = _MetadataUnpickler(file, path).load()
    if not isinstance(metadata, Metadata):
        raise CorruptIndexError(
            f"{path} holds a {type(metadata).__name__}, not DCP's Metadata", path=str(path)
        )
    _check_fields(metadata, path)
    return metadata


def _is_extent(value: object, dimensions: int | None = None) -> bool:
    """A ``torch.Size`` of non-negative numbers (of ``dimensions`` of them, if given)."""
    return (
        isinstance(value, torch.Size)
        and all(number >= 0 for number in value)
        and (dimensions is None or len(value) == dimensions)
    )


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_fields(metadata: Metadata, path: Path) -> None:
    """What the rest of a load takes for granted of ``.metadata``: entries of DCP's two kinds, tensors with a dtype,
    sizes and chunks of their dimensions, and storage inside the checkpoint (plain file names, as its manifest
    has, and offsets and lengths that are byte counts). Whether the chunks tile their tensors, and the files hold
    them, is the loader's check (``training.check_chunks``), which knows which entries it reads."""

    def refuse(what: str) -> NoReturn:
        raise CorruptIndexError(
            f"{path} {what}: the file is damaged or crafted; choose another checkpoint", path=str(path)
        )

    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        refuse("lacks the table of entries or of their storage")
    if not isinstance(metadata.planner_data, dict | None):
        refuse(f"holds planner data of type {type(metadata.planner_data).__name__}")
    for name, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            refuse(f"declares {name!r} as a {type(entry).__name__}")
        properties = entry.properties
        if not (isinstance(properties, TensorProperties) and isinstance(properties.dtype, torch.dtype)):
            refuse(f"declares {name!r} without a dtype")
        if not _is_extent(entry.size):
            refuse(f"declares {name!r} of size {entry.size!r}")
        rank = len(entry.size)
        if not isinstance(entry.chunks, list) or not all(
            isinstance(chunk, ChunkStorageMetadata)
            and _is_extent(chunk.offsets, rank)
            and _is_extent(chunk.sizes, rank)
            for chunk in entry.chunks
        ):
            refuse(f"declares chunks of {name!r} that are not offsets and sizes in its {rank} dimensions")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex):
            refuse(f"indexes its storage by a {type(index).__name__}")
        relative_path = getattr(info, "relative_path", None)
        if not is_file_name(relative_path):
            refuse(
                f"stores {index.fqn!r} in {relative_path!r}, which is not a file name: a checkpoint's files "
                "are in its own directory"
            )
        if not (_is_count(getattr(info, "offset", None)) and _is_count(getattr(info, "length", None))):
            refuse(f"stores {index.fqn!r} at an offset or length that is not a byte count")


class RestrictedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` goes through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(str(self.path)) / DCP_METADATA_NAME)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata sets too
        metadata.storage_meta = storage_meta
        return metadata


def load_plain(value: io.BytesIO, path: Path, name: str) -> Any:
    """The non-tensor entry ``name`` of the checkpoint ``path``, unpickled with ``weights_only=True``."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message advises weights_only=False, the opposite of what to do here: keep only its reason
        reasons = [line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        raise CorruptIndexError(
            f"{path}: the entry {name!r} is not a plain value (number, string, tuple, list, dict or tensor): "
            f"refusing to unpickle it ({' '.join(reasons) or type(error).__name__}). The checkpoint may be "
            "crafted; load only checkpoints you trust",
            path=str(path),
        ) from None


def check_plain_entries(path: Path, metadata: Metadata) -> None:
    """Every non-tensor entry of the checkpoint ``path`` unpickles as a plain value: run before ``dcp.load``
    touches the model, so a crafted entry fails with the model and optimizers unchanged."""
    plain = {
        name
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    for index, info in metadata.storage_data.items():
        if index.fqn not in plain:
            continue
        if info.transform_descriptors:  # DCP's writer as we call it adds none; reading them would need DCP's
            raise CorruptIndexError(
                f"{path}: the entry {index.fqn!r} is stored with transforms {list(info.transform_descriptors)}, "
                "which a checkpoint of the d9d strategy never has",
                path=str(path),
            )
        with open(path / info.relative_path, "rb") as file:
            file.seek(info.offset)
            load_plain(io.BytesIO(file.read(info.length)), path, index.fqn)


class RestrictedLoadPlanner(BoxedLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor ("bytes") entries are unpickled with ``weights_only=True`` (and
    whose strided shards load box by box: :mod:`.boxes`).

    :func:`check_plain_entries` has refused a crafted entry before the load starts; this keeps ``dcp.load``
    itself from unpickling anything else should the files change in between.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_plain(value, self.path, fqn)
        # the default planner's own two cases: a flattened state dict sets the nested original in place
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        *parents, last = self.mappings[fqn]
        container: Any = self.original_state_dict
        for key in parents:  # the state dict handed to dcp.load already holds every container
            container = container[key]
        container[last] = loaded
