"""A checkpoint directory that appears complete or not at all, written by one rank or by many.

Files go to a hidden sibling ``.{name}.tmp-{host}-{pid}-XXXXXXXX`` (rank 0's host and process id). ``commit``
fsyncs it and renames it into place. Something
already at the destination is replaced only if it is one of ours (``is_ours``), and only once the new directory
is complete: it is renamed aside to ``.{name}.old-XXXXXXXX``, the new one renamed in, the old one deleted. The
next save of the same target cleans up after a crashed one: it deletes ``.tmp-`` directories whose save is over
(its process is gone on this host, or, from another host, untouched for a day), and an ``.old-`` one is put back
if the crash came between the two renames (the destination is missing), else deleted. A save of another job to
the same path that is still running keeps its temporary directory (the last rename wins). ``put_back_interrupted``
puts such copies back in a whole folder without saving (the strategy runs it on the ``ModelCheckpoint`` folders
before a run starts, so ``ckpt_path="last"`` finds the ``last`` that a crash left aside).

Distributed (``distributed=True``): every rank calls ``open``, ``gather`` and ``commit`` in that order. Rank 0
creates, finishes and moves the directory; every step ends in an exchange of each rank's failure, so when one
rank fails (rank 0 writing its files or renaming, any rank writing its part) every rank raises promptly with
that rank's reason, instead of waiting in a barrier for the process-group timeout, and the temporary directory
is removed. The destination must be on a file system all ranks see.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lightning_d9d.mesh.arrival import CollectiveError, named_collective

from .errors import CheckpointError, CheckpointFileError

T = TypeVar("T")


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to stable storage: a rename is durable only once its directory is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def aside_prefix(final: Path) -> str:
    return f".{final.name}.old-"


STALE_SECONDS = 24 * 3600  # a temporary directory of another host untouched this long belongs to a dead save


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def save_in_progress(temporary: Path, prefix: str) -> bool:
    """Whether the temporary directory ``temporary`` may still be written by a running save (another job's)."""
    owner, _, _token = temporary.name[len(prefix) :].rpartition("-")  # "{host}-{pid}", the random token
    host, _, pid = owner.rpartition("-")
    if not host or not pid.isdigit():
        return False  # no owner recorded: an old save's, or not ours
    if host != socket.gethostname():
        return time.time() - temporary.stat().st_mtime < STALE_SECONDS
    return int(pid) != os.getpid() and _alive(int(pid))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def interrupted_replacement(final: Path) -> Path | None:
    """The previous ``final`` left aside by a save that crashed between its two renames, if any (the next save
    of ``final`` puts it back)."""
    if final.exists() or not final.parent.is_dir():
        return None
    aside = [entry for entry in final.parent.iterdir() if entry.name.startswith(aside_prefix(final))]
    return max(aside, key=lambda path: path.stat().st_mtime, default=None)


def put_back(final: Path) -> bool:
    """Rename the copy of ``final`` that an interrupted replacement left aside (``interrupted_replacement``)
    back to ``final``; whether this call did. Safe to run in several processes at once (every rank before a
    resume): one rename wins, and the others find the copy gone or ``final`` back and leave it be."""
    try:
        previous = interrupted_replacement(final)
        if previous is None:
            return False
        os.rename(previous, final)
    except OSError as error:
        # Another process won: it renamed this copy between our look and our rename (it is gone), or put back
        # another one first (the rename found ``final`` there, not empty).
        if isinstance(error, FileNotFoundError) or final.exists():
            return False
        raise
    fsync(final.parent)
    return True


_ASIDE = re.compile(r"^\.(?P<name>.+)\.old-[0-9a-f]{8}$")  # aside_prefix(final) + secrets.token_hex(4)


def put_back_interrupted(folder: str | os.PathLike[str]) -> list[Path]:
    """``put_back`` every entry of ``folder`` whose replacement was interrupted between its two renames (the
    entry is missing, its previous copy aside): the paths this call put back."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = sorted({match["name"] for entry in folder.iterdir() if (match := _ASIDE.match(entry.name))})
    return [folder / name for name in names if put_back(folder / name)]


def gather_outcomes(step: str, mine: Any) -> list[Any]:
    """Every rank's ``mine`` (``all_gather_object`` over the default group). A rank that died or hung makes the
    collective fail (peer gone, or the process group's timeout): the error then names the step, the
    collective and the ranks that never arrived, instead of the backend's bare transport message alone."""
    import torch.distributed as dist

    outcomes: list[Any] = [None] * dist.get_world_size()
    try:
        with named_collective("the exchange of the ranks' outcomes (all_gather_object)"):
            dist.all_gather_object(outcomes, mine)
    except CollectiveError as error:
        raise CheckpointError(f"{step}: {error}") from error
    return outcomes


def agree(check: Callable[[], T], *, distributed: bool) -> T:
    """Run ``check`` on every rank and agree on the outcome: its value where every rank passed; else every rank
    raises (the failed rank its own error, the others the same type and message naming that rank), so no rank
    goes on into a collective the others have left."""
    result: T | None = None
    failure: BaseException | None = None
    try:
        result = check()
    except Exception as error:
        failure = error
    if not distributed:
        if failure is not None:
            raise failure
        return result  # type: ignore[return-value]

    mine = None if failure is None else (type(failure).__name__, str(failure), getattr(failure, "path", None))
    outcomes = gather_outcomes("agreeing on the checks of a checkpoint", mine)
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            name, message, path = outcome
            raise _rebuilt(name, f"rank {rank}: {message}", path)
    return result  # type: ignore[return-value]


def _rebuilt(name: str, message: str, path: str | None) -> Exception:
    """Another rank's error as this rank raises it: the same class where it is ours or a builtin one."""
    import builtins

    from . import errors

    kind = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, CheckpointFileError) and path is not None:
        return kind(message, path=path)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, CheckpointFileError):
        try:
            return kind(message)
        except TypeError:
            pass
    return CheckpointError(message)


class AtomicDirectory:
    """``open()`` → each rank writes into the returned temporary directory inside ``gather(write)`` →
    ``commit(finish)``. Any failure removes the temporary directory and leaves the destination as it was.

    ``is_ours(path)``: whether an existing ``path`` may be replaced; ``kind`` names what ours is, in the refusal.
    """

    def __init__(
        self, final: str | os.PathLike[str], *, is_ours: Callable[[Path], bool], kind: str, distributed: bool
    ) -> None:
        self.final = Path(final).absolute()
        self.is_ours, self.kind = is_ours, kind
        self.distributed = distributed
        self.rank, self.world_size = 0, 1
        if distributed:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"writing {self.final} with distributed=True needs an initialised torch.distributed"
                )
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.temp: Path | None = None

    # ------------------------------------------------------------------------------------------ the steps
    def open(self) -> Path:
        """Create the temporary directory (rank 0) and return it on every rank."""
        if self.temp is not None:
            return self.temp
        owner = f"{socket.gethostname()}-{os.getpid()}"
        name = [f"{temporary_prefix(self.final)}{owner}-{secrets.token_hex(4)}"]
        if self.distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(name, src=0)  # all ranks write into the directory rank 0 creates
        temp = self.final.parent / name[0]
        self._exchange(f"creating {temp}", None, self._on_rank_zero(lambda: self._prepare(temp)))
        self.temp = temp
        return temp

    def gather(self, write: Callable[[], T]) -> list[T]:
        """Run this rank's part of the writing (``write`` fsyncs what it writes); return every rank's result in
        rank order, or raise on every rank if any rank failed."""
        self._require_open()
        result: T | None = None
        failure: BaseException | None = None
        try:
            result = write()
        except BaseException as error:
            failure = error
        return self._exchange(f"writing {self.final}", result, failure)  # type: ignore[return-value]

    def commit(self, finish: Callable[[Path], None] | None = None) -> Path:
        """Rank 0 runs ``finish(temp)`` (the files only it writes; fsync them), then fsyncs the directory and
        moves it into place; every rank returns once it is there, or raises rank 0's reason."""
        temp = self._require_open()

        def complete() -> None:
            if finish is not None:
                finish(temp)
            fsync(temp)
            self._check_destination()  # again: something may have appeared there while the ranks wrote
            self._move_into_place(temp)

        self._exchange(f"finishing {self.final}", None, self._on_rank_zero(complete))
        self.temp = None
        return self.final

    def abort(self) -> None:
        """Remove the temporary directory (rank 0: others may still write into it until they abort too).
        Not collective; the destination is left as it was."""
        if self.temp is not None and self.rank == 0:
            _remove(self.temp)
        self.temp = None

    # ---------------------------------------------------------------------------------------- internals
    def _require_open(self) -> Path:
        if self.temp is None:
            raise RuntimeError(f"the temporary directory of {self.final} is not open (call open() first)")
        return self.temp

    def _on_rank_zero(self, step: Callable[[], None]) -> BaseException | None:
        if self.rank != 0:
            return None
        try:
            step()
        except BaseException as error:
            return error
        return None

    def _exchange(self, step: str, result: Any, failure: BaseException | None) -> list[Any]:
        """Every rank's result, or (when any rank failed) the temporary directory removed and an error raised on
        every rank: the failed rank's own, the others one naming it and its reason."""
        if self.distributed:
            mine = (None, _describe(failure)) if failure is not None else (result, None)
            gathered = gather_outcomes(step, mine)
        else:
            gathered = [(result, None if failure is None else _describe(failure))]
        failed = [(rank, reason) for rank, (_, reason) in enumerate(gathered) if reason is not None]
        if not failed:
            return [value for value, _ in gathered]
        self.abort()
        if failure is not None:
            raise failure
        rank, reason = failed[0]
        raise CheckpointError(f"{step} failed on rank {rank}: {reason}")

    def _check_destination(self) -> None:
        if (self.final.exists() or self.final.is_symlink()) and not self.is_ours(self.final):
            raise CheckpointFileError(
                f"refusing to replace {self.final}: it exists and is not {self.kind}. Move it away or choose "
                "another path",
                path=str(self.final),
            )

    def _siblings(self, prefix: str) -> list[Path]:
        if not self.final.parent.is_dir():
            return []
        return sorted(entry for entry in self.final.parent.iterdir() if entry.name.startswith(prefix))

    def _prepare(self, temp: Path) -> None:
        """Clean up after crashed saves of this target, check the destination, create ``temp``."""
        for stale in self._siblings(temporary_prefix(self.final)):
            if not save_in_progress(stale, temporary_prefix(self.final)):
                _remove(stale)
        # A crash between the two renames: the old checkpoint is the last complete one, so it comes back.
        put_back(self.final)
        for old in self._siblings(aside_prefix(self.final)):  # a crash after the new one was in place
            _remove(old)
        self._check_destination()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        temp.mkdir()

    def _move_into_place(self, temp: Path) -> None:
        if not (self.final.exists() or self.final.is_symlink()):
            os.rename(temp, self.final)
            fsync(self.final.parent)
            return
        aside = self.final.parent / f"{aside_prefix(self.final)}{secrets.token_hex(4)}"
        os.rename(self.final, aside)
        try:
            os.rename(temp, self.final)
        except BaseException:
            os.rename(aside, self.final)
            raise
        fsync(self.final.parent)  # the new checkpoint is durable before the old one goes
        _remove(aside)
