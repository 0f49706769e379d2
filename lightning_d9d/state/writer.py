"""Streaming, atomic writer of HF-style sharded safetensors checkpoints.

Tensors arrive one at a time and fill a shard up to ``max_shard_bytes``; a full shard is written and forgotten, so
at most one shard is held in memory. Files go to a hidden sibling directory (``.{name}.tmp-XXXX``) and get their
final names (``model-00001-of-0000N.safetensors``, N known only at the end) on commit; the index is written last,
and the directory is then renamed into place (``AtomicDirectory``, shared with the training checkpoint). A reader
therefore finds the checkpoint complete or absent. An existing checkpoint at the destination is replaced only once
the new one is complete, and only if it is a safetensors checkpoint; leftovers of crashed saves are cleaned up.

One shard, as in ``transformers``' ``save_pretrained``, is written as ``model.safetensors`` without an index.
``extra_files`` (``config.json``, tokenizer files) are written into the same temporary directory, so they appear
together with the weights or not at all.

Distributed mode (``distributed=True``): every rank writes the keys it was given into its own shards in a shared
temporary directory; ``commit`` is collective, and rank 0 numbers the shards, writes the index and renames the
directory. A failure on any rank in ``commit`` (its last shard, rank 0's index or rename) raises on every rank.
The destination must be on a file system all ranks see.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from .atomic import AtomicDirectory, fsync
from .dtensor import is_dtensor
from .errors import CheckpointError
from .reader import INDEX_NAME, SINGLE_FILE_NAME

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size
FORMAT_METADATA = {"format": "pt"}  # transformers checks this field when loading a safetensors file


@dataclass(frozen=True)
class _Shard:
    rank: int
    temp_name: str
    keys: tuple[str, ...]
    nbytes: int


def parse_size(size: int | str) -> int:
    """A byte count from ``5_000_000_000``, ``"5GB"``, ``"500MB"``, ``"2GiB"`` or ``"1024"``."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().replace("_", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)]:
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"cannot read a size from {size!r}: write e.g. 5GB, 500MB, 2GiB or a byte count"
        ) from None


def _looks_like_checkpoint(path: Path, single_file: str = SINGLE_FILE_NAME) -> bool:
    """Only a checkpoint (or nothing) may be replaced: never a directory of other things passed by mistake."""
    if not path.is_dir():
        return False
    names = {entry.name for entry in path.iterdir()}
    return not names or INDEX_NAME in names or SINGLE_FILE_NAME in names or single_file in names


def _as_bytes(content: bytes | str) -> bytes:
    return content.encode() if isinstance(content, str) else bytes(content)


def _check_extra_name(name: str) -> None:
    """Extra files sit beside the shards: a plain name that cannot collide with a shard or the index."""
    if not name or name != Path(name).name or name.startswith("."):
        raise ValueError(f"extra file name {name!r} must be a plain file name (no directories, not hidden)")
    if name.endswith(".safetensors") or name == INDEX_NAME:
        raise ValueError(f"extra file name {name!r} would collide with the checkpoint's own files")


def _owned(tensor: Tensor) -> Tensor:
    """A dense CPU tensor that owns exactly its bytes, so a shard's memory is what it says it is.

    Views (an unstacked expert, a chunk of qkv) would otherwise pin their whole base tensor, and safetensors
    refuses tensors that share storage.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")  # may keep a non-contiguous layout: the check below still applies
    if (
        not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.nbytes
    ):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _check_disjoint(shards: list[_Shard]) -> list[_Shard]:
    """No key was written by two ranks (every rank checks the same gathered list, so all raise together)."""
    seen: dict[str, int] = {}
    for shard in shards:
        for key in shard.keys:
            if key in seen:
                raise CheckpointError(f"{key!r} was written by ranks {seen[key]} and {shard.rank}")
            seen[key] = shard.rank
    return shards


def _raise(error: BaseException) -> None:
    raise error


class ShardedWriter:
    """``with ShardedWriter(directory, max_shard_bytes=...) as writer: writer.add(key, tensor)``.

    Leaving the ``with`` block normally commits; an exception aborts (the temporary directory is deleted and an
    existing checkpoint at ``directory`` is untouched). Distributed, a rank that leaves with an exception still
    joins the ranks' exchange, so that ranks committing meanwhile raise at once, naming it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: Mapping[str, str] | None = None,
        distributed: bool = False,
        extra_files: Mapping[str, bytes | str] | None = None,
        single_file: str | None = None,
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes ({max_shard_bytes}) must be positive")
        self.directory = Path(directory).absolute()
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {**FORMAT_METADATA, **(metadata or {})}
        self.extra_files = {name: _as_bytes(content) for name, content in (extra_files or {}).items()}
        for name in self.extra_files:
            _check_extra_name(name)
        self.distributed = distributed
        # every tensor in one file of this name, no index (peft's adapter_model.safetensors): small checkpoints
        self.single_file = single_file
        if single_file is not None:
            if single_file != Path(single_file).name or not single_file.endswith(".safetensors"):
                raise ValueError(
                    f"single_file {single_file!r} must be a plain file name ending in .safetensors"
                )
            self.max_shard_bytes = 2**62  # one buffer, written once
        own_file = single_file or SINGLE_FILE_NAME
        self._atomic = AtomicDirectory(
            self.directory,
            is_ours=lambda path: _looks_like_checkpoint(path, own_file),
            kind=f"a safetensors checkpoint (no {INDEX_NAME} or {own_file})",
            distributed=distributed,
        )
        self.rank = self._atomic.rank
        self._temp: Path | None = None
        self._buffer: dict[str, Tensor] = {}
        self._buffer_bytes = 0
        self._buffer_storages: set[int] = set()  # data pointers of the buffered tensors
        self._shards: list[_Shard] = []
        self._keys: set[str] = set()
        self._done = False

    # ------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ShardedWriter:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.commit()
        elif self.distributed and self._temp is not None and not self._done:
            # The other ranks may be in commit's exchange, waiting for this one: join it with the failure, so
            # they raise (naming this rank) instead of waiting for the process-group timeout.
            failure = error if isinstance(error, Exception) else RuntimeError(f"interrupted: {kind.__name__}")
            try:
                self._atomic.gather(lambda: _raise(failure))
            except BaseException:
                pass  # this rank's own error is the one that propagates
            finally:
                self.abort()
        else:
            self.abort()

    def open(self) -> None:
        """Create the temporary directory (collective in distributed mode). Called by ``__enter__``."""
        if self._temp is None:
            self._temp = self._atomic.open()  # all ranks write into the directory rank 0 creates

    # ---------------------------------------------------------------------------------------------- data
    def add(self, key: str, tensor: Tensor) -> None:
        """Queue ``tensor`` under ``key``; writes the current shard first if ``tensor`` would overflow it."""
        if self._done:
            raise RuntimeError(f"ShardedWriter for {self.directory} is already closed")
        if self._temp is None:
            self.open()
        if is_dtensor(tensor):
            raise CheckpointError(f"{key!r} is a DTensor: gather it (full_tensor()) before writing")
        if key in self._keys:
            raise CheckpointError(f"{key!r} is written twice to {self.directory}")
        tensor = _owned(tensor)
        self._keys.add(key)
        if self._buffer and self._buffer_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.nbytes and pointer in self._buffer_storages:
            tensor = tensor.clone()  # the same tensor under two keys (tied weights): safetensors wants copies
            pointer = tensor.untyped_storage().data_ptr()
        self._buffer[key] = tensor
        self._buffer_bytes += tensor.nbytes
        self._buffer_storages.add(pointer)
        if self._buffer_bytes >= self.max_shard_bytes:
            self._flush()  # a full shard leaves memory now, not when the next tensor happens to arrive

    def _flush(self) -> None:
        if not self._buffer:
            return
        assert self._temp is not None
        temp_name = f"part-{self.rank:05d}-{len(self._shards):05d}.safetensors"
        path = self._temp / temp_name
        save_file(self._buffer, str(path), metadata=self.metadata)
        fsync(path)
        self._shards.append(_Shard(self.rank, temp_name, tuple(self._buffer), self._buffer_bytes))
        self._buffer = {}
        self._buffer_bytes = 0
        self._buffer_storages = set()

    # ----------------------------------------------------------------------------------------- finishing
    def commit(self) -> Path:
        """Write the last shard, name the shards, write the index and move the directory into place."""
        if self._done:
            raise RuntimeError(f"ShardedWriter for {self.directory} is already closed")
        self.open()
        try:
            # Every rank's shards, once every rank has written its last one (or all raise if one could not).
            per_rank = self._atomic.gather(self._flush_last)
            shards = _check_disjoint([shard for rank_shards in per_rank for shard in rank_shards])
            self._atomic.commit(lambda temp: self._finish(temp, shards))
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.directory

    def _flush_last(self) -> list[_Shard]:
        self._flush()
        return self._shards

    def _finish(self, temp: Path, shards: list[_Shard]) -> None:
        """Rank 0: give the shards their final names and write the index and the extra files."""
        if self.single_file is not None:
            self._join(temp, shards, self.single_file)
        elif not shards:  # an empty checkpoint is still a valid checkpoint: one empty file
            save_file({}, str(temp / SINGLE_FILE_NAME), metadata=self.metadata)
            fsync(temp / SINGLE_FILE_NAME)
        elif len(shards) == 1:
            os.rename(temp / shards[0].temp_name, temp / SINGLE_FILE_NAME)
        else:
            weight_map: dict[str, str] = {}
            for number, shard in enumerate(shards, start=1):
                final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                os.rename(temp / shard.temp_name, temp / final)
                weight_map.update(dict.fromkeys(shard.keys, final))
            index = {
                "metadata": {"total_size": sum(shard.nbytes for shard in shards)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (temp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            fsync(temp / INDEX_NAME)
        for name, content in self.extra_files.items():
            (temp / name).write_bytes(content)
            fsync(temp / name)

    def _join(self, temp: Path, shards: list[_Shard], name: str) -> None:
        """Rank 0: every shard's tensors (parts several ranks wrote) in the one file ``name``."""
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(temp / shard.temp_name)))
            (temp / shard.temp_name).unlink()
        save_file(tensors, str(temp / name), metadata=self.metadata)
        fsync(temp / name)

    def abort(self) -> None:
        """Forget everything written so far; the destination is left as it was."""
        self._buffer = {}
        self._buffer_storages = set()
        self._done = True
        if self._temp is None:
            return
        if self.rank != 0:  # rank 0 removes the directory; other ranks may still be writing into it
            for shard in self._shards:
                (self._temp / shard.temp_name).unlink(missing_ok=True)
        self._atomic.abort()
