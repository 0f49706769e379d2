"""The manifest of a training checkpoint: every file it holds, with its size and CRC-32, written last.

A checkpoint directory is complete only if its ``manifest.json`` is there and every file it lists has the size
and checksum it gives. The manifest is the last file a save writes (after ``meta.pt``), so a directory whose
save was interrupted has none, and one damaged afterwards (a truncated copy, flipped bytes, a lost shard)
disagrees with it. CRC-32 (``zlib.crc32``) catches the accidents a file system or a copy makes; it is not a
defence against someone forging a checkpoint.

Checksumming reads every file once more (from the page cache right after a save). The ranks split the files
between them, on save and on load, and each file is checksummed in 64 MiB pieces by a few threads at once
(``zlib.crc32`` lets go of the GIL), so the cost per rank falls with the ranks and the cores: see
``docs/reliability.md`` for what it costs.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import CorruptIndexError, CorruptShardError, MissingShardError

MANIFEST_NAME = "manifest.json"
FORMAT = "lightning_d9d.checkpoint-manifest"
VERSION = 1
PIECE_BYTES = 64 << 20  # one CRC-32 per 64 MiB piece: pieces are checksummed in parallel
_READ = 8 << 20  # each piece is read in 8 MiB reads: memory stays bounded for any file size
_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: tuple[int, ...]  # one per PIECE_BYTES piece of the file, in order


def _piece_crc(fd: int, start: int, end: int) -> int:
    crc, position = 0, start
    while position < end:
        data = os.pread(fd, min(_READ, end - position), position)
        if not data:
            break
        crc = zlib.crc32(data, crc)
        position += len(data)
    return crc


def checksum(path: Path) -> FileEntry:
    """Size and per-piece CRC-32s of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        starts = range(0, max(size, 1), PIECE_BYTES)
        if len(starts) == 1:
            return FileEntry(size, (_piece_crc(fd, 0, size),))
        with ThreadPoolExecutor(min(_THREADS, len(starts))) as pool:
            crcs = pool.map(lambda start: _piece_crc(fd, start, min(start + PIECE_BYTES, size)), starts)
            return FileEntry(size, tuple(crcs))
    finally:
        os.close(fd)


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of ``names`` (every ``world_size``-th file of the sorted list): ranks split the reading."""
    return sorted(names)[rank::world_size]


def write_manifest(directory: Path, entries: Mapping[str, FileEntry]) -> Path:
    """Write (and fsync) ``manifest.json`` listing ``entries``; call it after every listed file is written."""
    content = {
        "format": FORMAT,
        "version": VERSION,
        "piece_bytes": PIECE_BYTES,
        "files": {name: {"size": e.size, "crc32": list(e.crc32)} for name, e in sorted(entries.items())},
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
        if content.get("piece_bytes") != PIECE_BYTES:
            raise ValueError(f"piece_bytes {content.get('piece_bytes')!r}, this version uses {PIECE_BYTES}")
        entries = {
            str(name): FileEntry(int(entry["size"]), tuple(int(crc) for crc in entry["crc32"]))
            for name, entry in content["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptIndexError(
            f"{path} is damaged ({type(error).__name__}: {error}); choose another checkpoint", path=str(path)
        ) from error
    for name in entries:
        if not is_file_name(name):
            raise CorruptIndexError(f"{path} lists {name!r}, which is not a file name", path=str(path))
    return entries


def is_file_name(name: object) -> bool:
    """Whether ``name`` is a plain file name, so that ``directory / name`` stays in the directory: not absolute,
    no separator, not ``..``. A checkpoint's own lists of its files (this manifest, DCP's ``.metadata``) must
    name their files so, or they could make a load read files outside the checkpoint they vouch for."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


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
        actual, listed = checksum(file).crc32, entries[name].crc32
        if actual != listed:
            piece = next((i for i, (a, b) in enumerate(zip(actual, listed, strict=False)) if a != b), 0)
            raise CorruptShardError(
                f"{file} is damaged: the CRC-32 of its bytes {piece * PIECE_BYTES} to "
                f"{(piece + 1) * PIECE_BYTES} does not match {directory / MANIFEST_NAME}; choose another "
                "checkpoint",
                path=str(file),
            )


def verify(directory: Path, *, rank: int = 0, world_size: int = 1) -> None:
    """The manifest of ``directory`` is readable, every file it lists has its size, and this rank's share of
    them (all of them on one rank) their CRC-32s: what a resume and ``convert dcp-to-hf`` check first."""
    entries = read_manifest(directory)
    check_sizes(directory, entries)  # cheap, and names a truncated or missing file before any checksum
    check_checksums(directory, entries, share(list(entries), rank, world_size))
