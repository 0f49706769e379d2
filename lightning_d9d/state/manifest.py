"""The manifest of a training checkpoint: every file it holds, with its size and CRC-32, written last.

A checkpoint directory is complete only if its ``manifest.json`` is there and every file it lists has the size
and checksum it gives. The manifest is the last file a save writes (after ``meta.pt``), so a directory whose
save was interrupted has none, and one damaged afterwards (a truncated copy, flipped bytes, a lost shard)
disagrees with it. CRC-32 (``zlib.crc32``) catches the accidents a file system or a copy makes; it is not a
defence against someone forging a checkpoint.

Checksumming reads every file once more (from the page cache right after a save); the ranks split the files
between them, on save and on load, so the cost per rank falls with the number of ranks.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import CorruptIndexError, CorruptShardError, MissingShardError

MANIFEST_NAME = "manifest.json"
FORMAT = "lightning_d9d.checkpoint-manifest"
VERSION = 1
_CHUNK = 8 << 20  # read in 8 MiB pieces: constant memory for any file size


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: int


def checksum(path: Path) -> FileEntry:
    """Size and CRC-32 of the file at ``path``."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := file.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
            size += read
    return FileEntry(size, crc)


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of ``names`` (every ``world_size``-th file of the sorted list): ranks split the reading."""
    return sorted(names)[rank::world_size]


def write_manifest(directory: Path, entries: Mapping[str, FileEntry]) -> Path:
    """Write (and fsync) ``manifest.json`` listing ``entries``; call it after every listed file is written."""
    content = {
        "format": FORMAT,
        "version": VERSION,
        "files": {name: {"size": e.size, "crc32": e.crc32} for name, e in sorted(entries.items())},
    }
    path = directory / MANIFEST_NAME
    with open(path, "w") as file:
        json.dump(content, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    return path


def read_manifest(directory: Path) -> dict[str, FileEntry]:
    """The entries of ``directory``'s manifest; an error naming it if it is missing or malformed."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise MissingShardError(
            f"checkpoint {directory} is incomplete: {path} is missing (no manifest.json: the file a save writes "
            "last), so its save was interrupted or it was copied in part; choose another checkpoint",
            path=str(path),
        )
    try:
        content = json.loads(path.read_text())
        if content.get("format") != FORMAT or content.get("version") != VERSION:
            raise ValueError(f"format {content.get('format')!r} version {content.get('version')!r}")
        entries = {
            str(name): FileEntry(int(entry["size"]), int(entry["crc32"]))
            for name, entry in content["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptIndexError(
            f"{path} is damaged ({type(error).__name__}: {error}); choose another checkpoint", path=str(path)
        ) from error
    for name in entries:
        if Path(name).name != name or name in (
            "",
            ".",
            "..",
        ):  # names only: never a path out of the directory
            raise CorruptIndexError(f"{path} lists {name!r}, which is not a file name", path=str(path))
    return entries


def check_sizes(directory: Path, entries: Mapping[str, FileEntry]) -> None:
    """Every listed file exists with its size (cheap: no file is read)."""
    for name, entry in sorted(entries.items()):
        file = directory / name
        if not file.is_file():
            raise MissingShardError(
                f"checkpoint {directory} is incomplete: {file}, listed in its {MANIFEST_NAME}, does not exist",
                path=str(file),
            )
        size = file.stat().st_size
        if size != entry.size:
            raise CorruptShardError(
                f"{file} has {size} bytes, but {directory / MANIFEST_NAME} lists {entry.size}: the file is "
                "truncated or was replaced; choose another checkpoint",
                path=str(file),
            )


def check_checksums(directory: Path, entries: Mapping[str, FileEntry], names: Iterable[str]) -> None:
    """The listed files ``names`` have the CRC-32 the manifest gives (call :func:`check_sizes` first)."""
    for name in names:
        file = directory / name
        actual = checksum(file)
        if actual != entries[name]:
            raise CorruptShardError(
                f"{file} is damaged: its CRC-32 is {actual.crc32:08x}, but {directory / MANIFEST_NAME} lists "
                f"{entries[name].crc32:08x}; choose another checkpoint",
                path=str(file),
            )
