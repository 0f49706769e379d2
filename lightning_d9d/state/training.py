"""The training checkpoint of ``Trainer(strategy="d9d")``: its files, its layout, how it is saved and loaded.

Layout (the same as Lightning's ``ModelParallelStrategy``, so its tools still read it): a directory holding the
``torch.distributed.checkpoint`` (DCP) files (``.metadata`` plus ``*.distcp``) of ``{"state_dict": ...,
"optimizer_0": ...}``, and ``meta.pt`` with everything else (loops, callbacks, hyper-parameters) as
``torch.save`` wrote it. Optimizer state is flattened (``state.<fqn>.exp_avg``) so that every pipeline stage's
entries survive DCP's de-duplication of non-tensor values. Callbacks' states sit in ``meta["callbacks"]`` under
their state keys; ``LoadHFWeights`` and ``ExportHF`` record the model's Hugging Face config there as
``"hf_config"``, which ``python -m lightning_d9d.convert dcp-to-hf`` reads.

Saving is atomic and agreed across ranks (``AtomicDirectory``): the directory appears complete or not at all,
and replaces only a training checkpoint, an empty directory or a checkpoint file Lightning wrote (see
:func:`is_lightning_checkpoint_file`), never other data. The last file written is ``manifest.json``
(``manifest.py``): every other file with its size and CRC-32.

Loading checks every file before it touches the model, and the ranks agree on the outcome (one rank's damaged
view fails every rank, with that rank's reason): the manifest (sizes, then checksums, each rank a share of the
files), ``meta.pt`` (``weights_only`` unless the caller says otherwise), ``.metadata`` (through an allow-list,
never a plain unpickle, its files named by plain file names), every tensor's chunks tiling it exactly and
each stored within an existing ``.distcp`` file in no fewer bytes than it holds (:func:`check_chunks`), and
every non-tensor entry must unpickle as a plain value (``untrusted.py``). A folder of checkpoints resolves to
the newest complete one (``selection.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickletools
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from . import manifest, rng, selection, untrusted
from .atomic import AtomicDirectory, agree, fsync, interrupted_replacement
from .boxes import BoxedSavePlanner
from .errors import (
    CheckpointError,
    CheckpointFileError,
    CorruptIndexError,
    CorruptShardError,
    MissingShardError,
    format_keys,
)
from .frozen import FINGERPRINT_KEY, check_same_base

# the file names (defined with the choice of a checkpoint, which training.py builds on)
META_NAME, DCP_METADATA_NAME = selection.META_NAME, selection.DCP_METADATA_NAME
MODEL_SECTION = "state_dict"
CALLBACKS_SECTION = "callbacks"
HF_CONFIG_KEY = "hf_config"  # in a callback's state: the model's Hugging Face config (a dict)
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"  # in every checkpoint dict Lightning's Trainer writes
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_section(index: int) -> str:
    return f"optimizer_{index}"


def is_training_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_NAME).is_file() and (path / DCP_METADATA_NAME).is_file()


def is_lightning_checkpoint_file(path: Path) -> bool:
    """Whether the file ``path`` is a checkpoint Lightning wrote: a ``torch.save`` archive (a zip whose one
    folder holds ``data.pkl``, stored uncompressed as torch writes it) whose pickle holds the key every Trainer
    checkpoint has. The pickle's opcodes are parsed, never run (``pickletools``), so a crafted file runs nothing
    here. The suffix ``.ckpt`` alone would not do (any file may be named so), nor would any ``torch.save`` file (a
    user's tensors are data too)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [
                info
                for info in archive.infolist()
                if info.filename.count("/") == 1 and info.filename.endswith("/data.pkl")
            ]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return False
            with archive.open(pickles[0]) as stream:
                return any(argument == LIGHTNING_VERSION_KEY for _, argument, _ in pickletools.genops(stream))
    # not a zip, one zipfile cannot read (encrypted: RuntimeError), or a pickle cut short
    except (OSError, EOFError, ValueError, RuntimeError, zipfile.BadZipFile):
        return False


def _replaceable(path: Path) -> bool:
    """What a save may replace: a training checkpoint, an empty directory, or a checkpoint file Lightning wrote
    (``last.ckpt`` of a run that saved files: another strategy's, or ``save_distributed_checkpoint=False``)."""
    if path.is_dir():
        return is_training_checkpoint(path) or not any(path.iterdir())
    return path.is_file() and is_lightning_checkpoint_file(path)


def recorded_hf_config(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Hugging Face config recorded in ``meta`` (the content of ``meta.pt``) by a callback or, at the top
    level, by the strategy at save time; None if neither did."""
    for state in (meta.get(CALLBACKS_SECTION) or {}).values():
        if isinstance(state, Mapping) and isinstance(state.get(HF_CONFIG_KEY), dict):
            return dict(state[HF_CONFIG_KEY])
    return dict(meta[HF_CONFIG_KEY]) if isinstance(meta.get(HF_CONFIG_KEY), dict) else None


def optimizer_state(module: nn.Module, optimizer: Optimizer, *, cpu_offload: bool = True) -> dict[str, Any]:
    """The optimizer's flattened state (see the module docstring); ``cpu_offload``: copied to CPU memory now
    (a synchronous save), else left where it is (a background save's stager copies it)."""
    options = OPTIMIZER_OPTIONS if cpu_offload else dataclasses.replace(OPTIMIZER_OPTIONS, cpu_offload=False)
    return get_optimizer_state_dict(module, optimizer, options=options)


# --------------------------------------------------------------------------------------------------- saving
def save(path: str | os.PathLike[str], checkpoint: Mapping[str, Any]) -> Path:
    """Write Lightning's ``checkpoint`` dict to ``path``; every rank of the default process group calls it (or
    one process without one). Returns once the directory is in place on every rank, or raises on every rank."""
    directory, sections, meta = _open(path, checkpoint)
    temp = directory.open()

    def write_tensors_and_checksum() -> tuple[dict[str, manifest.FileEntry], Any]:
        # a strided shard's parts as chunks of their own (expert-tensor parallelism: state/boxes.py)
        _dcp_result(
            directory, temp, lambda: dcp.save(sections, checkpoint_id=temp, planner=BoxedSavePlanner())
        )
        return _checksum_share(directory, temp), rng.collect()

    return _commit(directory, meta, directory.gather(write_tensors_and_checksum))


class PendingSave:
    """A save whose tensors are being written in the background (:func:`save_async`): each rank's write is followed,
    in the background too, by the checksums of its share of the files; :meth:`finish` then writes ``meta.pt`` and
    the manifest and moves the directory into place, as :func:`save` does after its write. Until then the
    checkpoint does not exist under its name."""

    def __init__(
        self,
        directory: AtomicDirectory,
        meta: dict[str, Any],
        written: Future[dict[str, manifest.FileEntry]],
        rng_state: Any,
    ) -> None:
        self.directory, self.meta, self.written, self.rng_state = directory, meta, written, rng_state

    @property
    def final(self) -> Path:
        return self.directory.final

    def done(self) -> bool:
        """Whether this rank's background write and checksums have ended (done or failed)."""
        return self.written.done()

    def wait(self) -> None:
        """Wait for this rank's background work to end; its failure is raised."""
        self.written.result()

    def finish(self) -> Path:
        """A collective of the default group (every rank, in the main thread): see the class docstring."""
        self.directory.open()
        # each rank's failure reaches every rank through gather (all raise, with that rank's reason)
        return _commit(
            self.directory, self.meta, self.directory.gather(lambda: (self.written.result(), self.rng_state))
        )


def save_async(
    path: str | os.PathLike[str],
    checkpoint: Mapping[str, Any],
    group: dist.ProcessGroup | None,
    stager: AsyncStager | None = None,
) -> PendingSave:
    """Start :func:`save` with the tensors copied to CPU memory now and written in a background thread
    (``torch.distributed.checkpoint.async_save``), whose collectives run over ``group`` (a process group of its
    own: the training thread's collectives on the default group go on meanwhile); then, in another background
    thread, this rank's share of the checksums (``zlib.crc32`` lets go of the GIL on large buffers). ``stager``:
    how the tensors are copied to CPU memory (a caller's stager reuses its pinned buffers across saves; the
    caller must not stage the next save before this one's write ended). The random states are those of now.
    Every rank calls it, then later :meth:`PendingSave.finish`."""
    directory, sections, meta = _open(path, checkpoint)
    temp = directory.open()
    write = dcp.async_save(
        sections, checkpoint_id=temp, process_group=group, async_stager=stager, planner=BoxedSavePlanner()
    )
    if not isinstance(write, Future):  # a response with two futures comes only with an async stager
        raise TypeError(
            f"torch.distributed.checkpoint.async_save returned {type(write).__name__}, not a Future"
        )

    def write_then_checksum() -> dict[str, manifest.FileEntry]:
        _dcp_result(directory, temp, write.result)
        return _checksum_share(directory, temp)

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d9d-checksums")
    written = executor.submit(write_then_checksum)
    executor.shutdown(wait=False)  # the thread ends with its one task
    return PendingSave(directory, meta, written, rng.collect())


def _open(
    path: str | os.PathLike[str], checkpoint: Mapping[str, Any]
) -> tuple[AtomicDirectory, dict[str, Any], dict[str, Any]]:
    """The atomic directory for ``path``, the DCP sections (model, optimizers) and the rest (``meta.pt``)."""
    meta = dict(checkpoint)
    sections = {MODEL_SECTION: meta.pop("state_dict")}
    sections.update({optimizer_section(i): state for i, state in enumerate(meta.pop("optimizer_states", []))})
    directory = AtomicDirectory(
        path,
        is_ours=_replaceable,
        kind=(
            f"a training checkpoint (a directory with {META_NAME} and {DCP_METADATA_NAME}), an empty directory or "
            "a checkpoint file Lightning wrote"
        ),
        distributed=dist.is_available() and dist.is_initialized(),
    )
    return directory, sections, meta


def _dcp_result(directory: AtomicDirectory, temp: Path, write: Callable[[], Any]) -> None:
    # DCP writes (and fsyncs) every rank's files and .metadata; a rank's failure reaches all through DCP.
    try:
        write()
    except CheckpointException as error:
        raise CheckpointFileError(
            f"writing the model and optimizer state of {directory.final} failed on ranks "
            f"{sorted(error.failures)}: {dcp_failure_reason(error)}",
            path=str(temp),
        ) from error


def _checksum_share(directory: AtomicDirectory, temp: Path) -> dict[str, manifest.FileEntry]:
    # every rank's files exist once the write returned: each rank checksums its share (page-cache reads)
    names = [entry.name for entry in temp.iterdir() if entry.name not in (META_NAME, manifest.MANIFEST_NAME)]
    mine = manifest.share(names, directory.rank, directory.world_size)
    return {name: manifest.checksum(temp / name) for name in mine}


def _commit(
    directory: AtomicDirectory,
    meta: dict[str, Any],
    gathered: list[tuple[dict[str, manifest.FileEntry], Any]],
) -> Path:
    shares, rng_states = zip(*gathered, strict=True)
    meta[rng.RNG_KEY] = list(rng_states)  # every rank's, in rank order

    def write_meta_then_manifest(temp: Path) -> None:
        torch.save(meta, temp / META_NAME)
        fsync(temp / META_NAME)
        entries = {name: entry for part in shares for name, entry in part.items()}
        entries[META_NAME] = manifest.checksum(temp / META_NAME)
        unlisted = {entry.name for entry in temp.iterdir()} - entries.keys()
        if unlisted:  # a file appeared that no rank checksummed: the manifest would not cover it
            raise CheckpointError(f"files without a checksum in {temp}: {format_keys(unlisted)}")
        manifest.write_manifest(temp, entries)  # last: its presence says the directory is complete

    return directory.commit(write_meta_then_manifest)


# -------------------------------------------------------------------------------------------------- loading
PATH_CLASSES: list[Any] = [PosixPath, WindowsPath, PurePosixPath, PureWindowsPath]


def read_meta(path: Path, *, weights_only: bool | None, map_location: str | None = None) -> dict[str, Any]:
    """The content of ``meta.pt``, with an error naming the file if it is missing or cannot be read."""
    meta_path = path / META_NAME
    if not meta_path.is_file():
        raise MissingShardError(
            f"checkpoint {path} is incomplete: {META_NAME} is missing. It was not written by the d9d strategy, "
            "or its save was interrupted; choose another checkpoint",
            path=str(meta_path),
        )
    try:
        # weights_only unless the caller asked otherwise: a checkpoint is untrusted input. Paths are plain values
        # (a LightningModule's hyperparameters often hold one; building one touches no file)
        with torch.serialization.safe_globals(PATH_CLASSES):
            meta = torch.load(meta_path, map_location=map_location, weights_only=weights_only is not False)
    except Exception as error:  # a truncated zip, or a pickle weights_only refuses: the reason says which
        raise CheckpointFileError(
            f"{meta_path} cannot be read ({type(error).__name__}: {error}); if it is truncated, choose another "
            "checkpoint",
            path=str(meta_path),
        ) from error
    if not isinstance(meta, dict):
        raise CheckpointFileError(
            f"{meta_path} holds a {type(meta).__name__}, not the dict of a Lightning checkpoint",
            path=str(meta_path),
        )
    return meta


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, with errors naming the file."""
    name = path / DCP_METADATA_NAME
    if not name.is_file():
        raise MissingShardError(
            f"{path} is not a torch.distributed.checkpoint directory: it has no {DCP_METADATA_NAME}",
            path=str(name),
        )
    try:
        metadata: Metadata = untrusted.read_metadata(name)
    except CorruptIndexError:
        raise
    except Exception as error:  # a pickle of DCP classes: anything can go wrong in a damaged file
        raise CorruptIndexError(f"{name} cannot be read: {error!r}", path=str(name)) from error
    return metadata


def check_chunks(path: Path, metadata: Metadata, names: Mapping[str, str] | None = None) -> None:
    """What ``.metadata`` says of each entry agrees with itself and with the files, before any tensor is allocated
    or read: every tensor's chunks tile it exactly (inside it, no gap, no overlap: DCP plans no read for a part no
    chunk covers, which then keeps whatever memory held), every chunk and non-tensor entry is stored, in no fewer
    bytes than the chunk holds (a declared size cannot outgrow the files), within an existing file, so a missing
    or truncated ``.distcp`` file fails here, naming file and entry. (The fields' types and the files' names were
    checked when ``.metadata`` was read: ``untrusted.read_metadata``.)

    ``names``: check only these entries (DCP's flat key → the name errors give it); default: all, by flat key.
    """
    index_file = path / DCP_METADATA_NAME
    file_sizes: dict[str, int] = {}
    entries = metadata.state_dict_metadata
    # only the named entries are visited: a reader checks each group it reads, and a checkpoint has thousands
    named = {flat: flat for flat in entries} if names is None else names
    for flat, name in named.items():
        entry = entries.get(flat)
        if entry is None:
            continue
        if not isinstance(entry, TensorStorageMetadata):  # a non-tensor entry: one pickle
            _check_stored(path, name, metadata.storage_data.get(MetadataIndex(flat)), "it", file_sizes)
            continue
        problem = _tiling_problem(entry.size, entry.chunks)
        if problem is not None:
            raise CorruptIndexError(
                f"{index_file} declares {name!r} of size {tuple(entry.size)}, but {problem}: the file is damaged "
                "or crafted; choose another checkpoint",
                path=str(index_file),
            )
        for chunk in entry.chunks:
            where = f"the chunk at {tuple(chunk.offsets)}"
            info = metadata.storage_data.get(MetadataIndex(flat, chunk.offsets))
            _check_stored(path, name, info, where, file_sizes)
            held = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if held > info.length:
                raise CorruptIndexError(
                    f"{index_file} declares {name!r} of size {tuple(entry.size)}: {where} holds {held} bytes, "
                    f"but its storage entry stores it in {info.length}: the file is damaged or crafted; "
                    "choose another checkpoint",
                    path=str(index_file),
                )


def _check_stored(path: Path, name: str, info: Any, what: str, file_sizes: dict[str, int]) -> None:
    """``what`` (a chunk of the entry ``name``, or the entry itself) has storage that lies within an existing file
    of the checkpoint; ``file_sizes`` caches the files' sizes."""
    if info is None:
        raise CorruptIndexError(
            f"{path / DCP_METADATA_NAME} lists no storage for {what} of {name!r}: the file is damaged or crafted; "
            "choose another checkpoint",
            path=str(path / DCP_METADATA_NAME),
        )
    file = path / info.relative_path
    if info.relative_path not in file_sizes:
        file_sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
    size = file_sizes[info.relative_path]
    if size < 0:
        raise MissingShardError(
            f"{path / DCP_METADATA_NAME} stores {name!r} in {file}, which does not exist", path=str(file)
        )
    if size < info.offset + info.length:
        raise CorruptShardError(
            f"{file} is truncated: it has {size} bytes, but {name!r} is stored up to byte "
            f"{info.offset + info.length}",
            path=str(file),
        )


def _tiling_problem(size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``size`` exactly, or None if they do."""
    for chunk in chunks:  # an empty chunk (an empty shard's) holds nothing, wherever it is
        if math.prod(chunk.sizes) > 0 and any(
            offset + extent > bound
            for offset, extent, bound in zip(chunk.offsets, chunk.sizes, size, strict=True)
        ):
            return f"the chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)} lies outside it"
    held, elements = sum(math.prod(chunk.sizes) for chunk in chunks), math.prod(size)
    if held != elements:
        return f"its chunks hold {held} of its {elements} elements"
    # inside it and as many elements as it has: a gap would need an overlap, so overlaps are what is left
    overlap = _first_overlap(chunks)
    if overlap is not None:
        first, second = overlap
        return f"the chunks at {tuple(first.offsets)} and {tuple(second.offsets)} overlap"
    return None


def _first_overlap(
    chunks: Sequence[ChunkStorageMetadata],
) -> tuple[ChunkStorageMetadata, ChunkStorageMetadata] | None:
    """Two chunks sharing an element, if any. A sweep along the dimension the chunks split most: only the chunks
    still open there are compared, a handful for the tilings DCP writes (a row of tp shards, say)."""
    boxes = [chunk for chunk in chunks if math.prod(chunk.sizes) > 0]
    if len(boxes) < 2:
        return None
    dimensions = range(len(boxes[0].sizes))
    axis = max(dimensions, key=lambda d: len({box.offsets[d] for box in boxes}))
    boxes.sort(key=lambda box: box.offsets[axis])
    still_open: list[ChunkStorageMetadata] = []
    for box in boxes:
        start = box.offsets[axis]
        still_open = [other for other in still_open if other.offsets[axis] + other.sizes[axis] > start]
        for other in still_open:
            if all(
                other.offsets[d] < box.offsets[d] + box.sizes[d]
                and box.offsets[d] < other.offsets[d] + other.sizes[d]
                for d in dimensions
            ):
                return other, box
        still_open.append(box)
    return None


def dcp_failure_reason(error: BaseException) -> str:
    """What went wrong in a failed ``dcp.load``: its ``CheckpointException`` carries whole tracebacks of the
    ranks' failures, whose last line says it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _own_failure(error: CheckpointException) -> CheckpointError | None:
    """The first of the ranks' failures that is one of our checkpoint errors (a refused entry), if any."""
    for failure, _ in error.failures.values():
        if isinstance(failure, CheckpointError):
            return failure
    return None


def _check_sections(path: Path, metadata: Metadata, optimizers: int) -> None:
    held = {flat.partition(".")[0] for flat in metadata.state_dict_metadata}
    missing = [MODEL_SECTION] if MODEL_SECTION not in held else []
    missing += [optimizer_section(i) for i in range(optimizers) if optimizer_section(i) not in held]
    if missing:
        raise CheckpointError(
            f"{path / DCP_METADATA_NAME} has no {format_keys(missing)} entries (it holds {format_keys(held)}): "
            "a checkpoint of another LightningModule, or saved with save_weights_only?"
        )


MetaCheck = Callable[[dict[str, Any]], None]  # a caller's own check of meta.pt's content: raises to refuse it


def _checked(
    path: Path, optimizers: int, weights_only: bool | None, check: MetaCheck | None = None
) -> dict[str, Any]:
    """This rank's checks of the checkpoint at ``path`` (its share of the checksums), then ``check(meta)``;
    ``meta.pt`` once every file checked out."""
    if not path.is_dir():
        previous = interrupted_replacement(path)
        if previous is not None:
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} does not exist: a save replacing it was interrupted, and the previous "
                f"checkpoint is {str(previous)!r}. Rename it back to {path.name!r} to resume from it"
            )
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; check ckpt_path")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    manifest.verify(path, rank=rank, world_size=world_size)
    meta = read_meta(path, weights_only=weights_only)
    metadata = read_dcp_metadata(path)
    _check_sections(path, metadata, optimizers)
    check_chunks(path, metadata)
    untrusted.check_plain_entries(path, metadata)
    if check is not None:
        check(meta)
    return meta


def load(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Mapping[int, Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    check: MetaCheck | None = None,
    frozen: Mapping[str, tuple[float, float, int]] | None = None,
) -> dict[str, Any]:
    """Load model and optimizer state in place (any mesh: DCP reshards) and return the rest (``meta.pt``).

    Every file is checked first, and every rank of the default process group (if any) agrees on the outcome: a
    damaged checkpoint raises an error naming the file on every rank, with the model and the optimizers
    untouched. ``check(meta)``: the caller's own checks of ``meta.pt``'s content, run with these (before the
    model is touched; what it raises, every rank raises). ``path`` may also be a folder of checkpoints: the
    newest complete one is loaded (see :func:`~lightning_d9d.state.selection.newest_complete`). ``frozen``: the
    model's frozen parameters' fingerprint (:func:`~lightning_d9d.state.frozen.fingerprint`, taken by the caller
    on every rank): a checkpoint that left them out (a LoRA run's) loads the rest, once its recorded fingerprint
    matches; one that holds them loads them too.
    """
    distributed = dist.is_available() and dist.is_initialized()
    named = Path(path).absolute()
    path = selection.resolve(named, distributed=distributed)

    def checks(meta: dict[str, Any]) -> None:
        if check is not None:
            check(meta)
        if FINGERPRINT_KEY in meta:
            check_same_base(meta[FINGERPRINT_KEY], frozen or {}, str(path))

    try:
        meta = agree(lambda: _checked(path, len(optimizers), weights_only, checks), distributed=distributed)
    except CheckpointError as error:
        # a checkpoint named directly (ckpt_path="last" too): say which other one is complete
        hint = selection.other_complete_hint(path) if path == named else None
        if hint is not None:
            error.add_note(hint)
        raise
    left_out = frozenset(frozen or ()) if FINGERPRINT_KEY in meta else frozenset()
    model_state = {key: value for key, value in get_model_state_dict(module).items() if key not in left_out}
    state: dict[str, Any] = {MODEL_SECTION: model_state}
    state.update({optimizer_section(i): optimizer_state(module, opt) for i, opt in optimizers.items()})
    try:
        dcp.load(
            state,
            checkpoint_id=path,
            storage_reader=untrusted.RestrictedFileSystemReader(path),
            planner=untrusted.RestrictedLoadPlanner(path),
        )
    except (Exception, CheckpointException) as error:  # DCP wraps the ranks' failures in a BaseException
        refused = _own_failure(error) if isinstance(error, CheckpointException) else None
        if refused is not None:  # an entry we refused: our error naming it, not DCP's dump of tracebacks
            raise refused from None
        raise CheckpointFileError(
            f"{path}: cannot load its model and optimizer state ({dcp_failure_reason(error)}). If it is a checkpoint of this model, "
            "a .distcp file is damaged",
            path=str(path),
        ) from error
    # what was left out is not missing: every other key was read (DCP refuses a requested key it lacks)
    set_model_state_dict(
        module, state[MODEL_SECTION], options=StateDictOptions(strict=strict and not left_out)
    )
    for i, opt in optimizers.items():
        set_optimizer_state_dict(
            module, opt, optim_state_dict=state[optimizer_section(i)], options=OPTIMIZER_OPTIONS
        )
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    rng.restore_rank(meta.pop(rng.RNG_KEY, None), rank, world_size)
    return meta
