"""Reading DCP's ``.metadata`` without unpickling arbitrary objects.

``torch.distributed.checkpoint.FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``: a crafted
checkpoint could run code on load. :class:`RestrictedFileSystemReader` unpickles it with an allow-list (DCP's
metadata classes, ``torch.Size``, dtypes, paths) and refuses anything else, naming the file and the object.
Tensor bytes themselves DCP already reads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CorruptIndexError
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
    return metadata


class RestrictedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` goes through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(str(self.path)) / DCP_METADATA_NAME)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata sets too
        metadata.storage_meta = storage_meta
        return metadata
