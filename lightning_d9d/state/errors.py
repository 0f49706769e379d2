"""Errors raised while planning, reading or writing a checkpoint.

Every error is a ``CheckpointError`` (a ``ValueError``: the input is wrong, not the program). Messages name
the file and the key, because with thousands of tensors spread over dozens of shards "shape mismatch" alone
sends a user digging.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_LISTED_KEYS = 10


def format_keys(keys: Iterable[str], limit: int = MAX_LISTED_KEYS) -> str:
    """``'a', 'b', 'c' and 7 more``: the first ``limit`` names in sorted order, then a count."""
    ordered = sorted(keys)
    shown = ", ".join(repr(key) for key in ordered[:limit])
    rest = len(ordered) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


class CheckpointError(ValueError):
    """Base of all errors of ``lightning_d9d.state``."""


class MapperError(CheckpointError):
    """A mapper graph is ill-formed: a key read or written twice, a group that does not fit its inputs."""


class NotInvertibleError(MapperError):
    """The mapper has no inverse (it drops keys, or forgets a dtype or a placement)."""


class KeyCoverageError(CheckpointError):
    """The keys of a checkpoint or a module do not match what the mapper graph reads or writes."""

    def __init__(
        self,
        message: str,
        *,
        missing_source: Iterable[str] = (),
        unexpected_source: Iterable[str] = (),
        missing_target: Iterable[str] = (),
        unexpected_target: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing_source = sorted(missing_source)
        self.unexpected_source = sorted(unexpected_source)
        self.missing_target = sorted(missing_target)
        self.unexpected_target = sorted(unexpected_target)


class CheckpointFileError(CheckpointError):
    """A file of a checkpoint is missing, unreadable or malformed."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class MissingShardError(CheckpointFileError):
    """The index names a shard file that is not there (or the directory has no checkpoint at all)."""


class CorruptShardError(CheckpointFileError):
    """A safetensors file whose header or size is wrong (typically a truncated copy)."""


class CorruptIndexError(CheckpointFileError):
    """``model.safetensors.index.json`` is not valid JSON or lacks its ``weight_map``."""


class MissingKeyError(CheckpointFileError):
    """The index says a key lives in a file, but that file does not hold it."""

    def __init__(self, message: str, *, path: str, key: str) -> None:
        super().__init__(message, path=path)
        self.key = key


class ShapeMismatchError(CheckpointError):
    """A tensor read from a checkpoint does not fit the parameter it is loaded into (shape or dtype)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class ConfigMismatchError(CheckpointError):
    """A checkpoint's ``config.json`` describes another model than the one it is loaded into (another
    ``model_type``, or the same family with other sizes). ``fields`` maps each differing field to
    ``(value in the file, value expected)``."""

    def __init__(self, message: str, *, path: str, fields: dict[str, tuple[object, object]]) -> None:
        super().__init__(message)
        self.path = path
        self.fields = fields
