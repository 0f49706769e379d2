"""Damaged and untrusted training checkpoints: the manifest's sizes and checksums, ranks agreeing on a damage
only one of them reads, a crafted ``.metadata``, and choosing the newest complete checkpoint of a folder."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from distributed import run_distributed
from test_training_checkpoint import assert_unchanged, lightning_checkpoint, snapshot, trained
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from lightning_d9d.state import DCPReader, Identity, manifest, selection
from lightning_d9d.state import dcp as dcp_reader
from lightning_d9d.state.errors import (
    CheckpointError,
    CorruptIndexError,
    CorruptShardError,
    MissingShardError,
)
from lightning_d9d.state.training import DCP_METADATA_NAME, load, save
from lightning_d9d.state.untrusted import read_metadata


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def saved(path: Path, seed: int = 0) -> Path:
    module, optimizer = trained(seed)
    save(path, lightning_checkpoint(module, optimizer))
    return path


def flip_a_byte(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0xFF
    path.write_bytes(bytes(content))


def failed_load(checkpoint: Path, error: type[Exception], match: str) -> str:
    """Load into a fresh module: the error raised (its message), with model and optimizer left untouched."""
    module, optimizer = trained(seed=1)
    before = snapshot(module, optimizer)
    with pytest.raises(error, match=match) as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert_unchanged(before, module, optimizer)
    return str(caught.value)


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")
    entries = manifest.read_manifest(checkpoint)
    on_disk = {entry.name for entry in checkpoint.iterdir()} - {manifest.MANIFEST_NAME}
    assert entries.keys() == on_disk and any(name.endswith(".distcp") for name in on_disk)
    for name, entry in entries.items():
        assert entry.size == (checkpoint / name).stat().st_size
    # written last: no file of the checkpoint is newer than it
    written = (checkpoint / manifest.MANIFEST_NAME).stat().st_mtime_ns
    assert all((checkpoint / name).stat().st_mtime_ns <= written for name in on_disk)


def test_flipped_bytes_in_a_shard_fail_naming_it(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")
    (shard,) = checkpoint.glob("*.distcp")
    flip_a_byte(shard)  # same size: only the checksum tells
    message = failed_load(checkpoint, CorruptShardError, "CRC-32")
    assert str(shard) in message


def test_a_deleted_manifest_makes_the_checkpoint_incomplete(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")
    (checkpoint / manifest.MANIFEST_NAME).unlink()
    message = failed_load(checkpoint, MissingShardError, "is incomplete")
    assert str(checkpoint / manifest.MANIFEST_NAME) in message


def test_a_damaged_manifest_fails_naming_it(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")
    (checkpoint / manifest.MANIFEST_NAME).write_text('{"format": "something else"}')
    assert str(checkpoint / manifest.MANIFEST_NAME) in failed_load(checkpoint, CorruptIndexError, "damaged")
    entries = manifest.read_manifest(saved(tmp_path / "other"))
    manifest.write_manifest(checkpoint, {"../outside": next(iter(entries.values()))})
    failed_load(checkpoint, CorruptIndexError, "not a file name")


class Payload:
    """What a crafted pickle would run on load: here it only leaves a mark."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(Payload.mark),))

    mark = Path()


def rewrite_metadata(checkpoint: Path, edit: Callable[[Metadata], None], *changed: Path) -> None:
    """Apply ``edit`` to the checkpoint's ``.metadata`` and make the manifest agree with it and with the files
    ``changed``, as a crafted checkpoint would (CRC-32 is no defence against forgery)."""
    metadata = read_metadata(checkpoint / DCP_METADATA_NAME)
    edit(metadata)
    write_metadata_pickle(checkpoint, pickle.dumps(metadata), *changed)


def write_metadata_pickle(checkpoint: Path, content: bytes, *changed: Path) -> None:
    (checkpoint / DCP_METADATA_NAME).write_bytes(content)
    entries = manifest.read_manifest(checkpoint)
    for file in (checkpoint / DCP_METADATA_NAME, *changed):
        if file.is_file():
            entries[file.name] = manifest.checksum(file)
        else:
            entries.pop(file.name)
    manifest.write_manifest(checkpoint, entries)


def test_a_crafted_dcp_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")
    Payload.mark = tmp_path / "was_run"
    write_metadata_pickle(checkpoint, pickle.dumps(Payload()))
    message = failed_load(checkpoint, CorruptIndexError, "refusing to unpickle")
    assert "posix.mkdir" in message and str(checkpoint / DCP_METADATA_NAME) in message
    assert not Payload.mark.exists()


def calling(module: str, name: str, *args: object) -> bytes:
    """A pickle that calls ``module.name(*args)`` when loaded, naming the callable exactly as given: a plain
    unpickler resolves a dotted ``name`` attribute by attribute."""
    call = pickle.dumps(args, protocol=2)[2:-1]  # the arguments' tuple, without its protocol and stop opcodes
    return b"\x80\x04c" + f"{module}\n{name}\n".encode() + call + b"R."


CALLABLES = {  # what each would do if the allow-list let it through
    "torch.save": lambda mark: calling("torch", "save", {"x": 1}, str(mark)),  # writes any file
    "torch.load": lambda mark: calling("torch", "load", str(mark.parent / "ckpt" / "meta.pt")),  # loads any
    "builtins.eval": lambda mark: calling("builtins", "eval", f"__import__('os').mkdir({str(mark)!r})"),
    # attributes of DCP's metadata module that are not its classes: a function, and one reached through its
    # `os` import
    "torch.distributed.checkpoint.metadata.field": lambda mark: calling(dcp_metadata.__name__, "field"),
    "torch.distributed.checkpoint.metadata.os.mkdir": lambda mark: calling(
        dcp_metadata.__name__, "os.mkdir", str(mark)
    ),
}


@pytest.mark.parametrize("name", list(CALLABLES))
def test_a_dcp_metadata_naming_a_callable_is_refused_on_both_paths(tmp_path: Path, name: str) -> None:
    """Only DCP's metadata classes, ``torch.Size``, dtypes and paths pass; in the ``torch`` namespace only
    dtypes (``torch.save`` and ``torch.load`` are its names too)."""
    checkpoint = saved(tmp_path / "ckpt")
    mark = tmp_path / "was_run"
    write_metadata_pickle(checkpoint, CALLABLES[name](mark))
    message = failed_load(checkpoint, CorruptIndexError, "refusing to unpickle")
    assert f"names {name}," in message and str(checkpoint / DCP_METADATA_NAME) in message
    with pytest.raises(CorruptIndexError, match=f"names {re.escape(name)},"):
        DCPReader(checkpoint)  # the reader of `convert dcp-to-hf`
    assert not mark.exists()


# ---------------------------------------------------------------- .metadata's chunks against its tensors
KEY, NAME = "state_dict.0.weight", "0.weight"  # a [16, 8] weight: its flat key, and its name in the reader


def retile(checkpoint: Path, boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> Path:
    """Store ``KEY`` as the chunks ``boxes`` (offsets, sizes), each one's bytes written honestly (its slice of the
    saved weight; zeros where it leaves the weight), with ``.metadata`` and the manifest agreeing."""
    weight = trained(seed=0)[0][0].weight.detach()
    metadata = read_metadata(checkpoint / DCP_METADATA_NAME)
    (index,) = [index for index in metadata.storage_data if index.fqn == KEY]
    info = metadata.storage_data.pop(index)
    shard = checkpoint / info.relative_path
    chunks = []
    for position, (offsets, sizes) in enumerate(boxes):
        block = weight[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]].clone()
        if block.shape != sizes:
            block = torch.zeros(sizes)
        buffer = io.BytesIO()
        torch.save(block, buffer)
        with open(shard, "ab") as file:
            offset = file.tell()
            file.write(buffer.getvalue())
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        stored = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
        metadata.storage_data[MetadataIndex(KEY, torch.Size(offsets), position)] = stored
    metadata.state_dict_metadata[KEY].chunks = chunks
    write_metadata_pickle(checkpoint, pickle.dumps(metadata), shard)
    return checkpoint


def exported(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors as ``convert dcp-to-hf`` reads them (``DCPReader``, streamed group by group)."""
    reader = DCPReader(checkpoint)
    return {
        key: value
        for result in reader.stream(Identity(reader.keys()))
        for key, value in result.outputs.items()
    }


def test_a_tensor_in_chunks_of_any_tiling_loads_on_both_paths(tmp_path: Path) -> None:
    """Bricks, not a grid: the rows split at 5 left of column 3 and at 9 right of it."""
    checkpoint = retile(
        saved(tmp_path / "ckpt"), [((0, 0), (5, 3)), ((5, 0), (11, 3)), ((0, 3), (9, 5)), ((9, 3), (7, 5))]
    )
    weight = trained(seed=0)[0][0].weight
    assert torch.equal(exported(checkpoint)[NAME], weight)
    module, optimizer = trained(seed=1)
    load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[0].weight, weight)


def refused_on_both_paths(checkpoint: Path, error: type[Exception], match: str) -> str:
    """The resume refuses the checkpoint with model and optimizer untouched, and the export refuses it before
    reading a tensor; both messages name the tensor and ``.metadata``. Returns the resume's message."""
    message = failed_load(checkpoint, error, match)
    assert repr(KEY) in message and str(checkpoint / DCP_METADATA_NAME) in message, message
    with pytest.raises(error, match=match) as caught:
        exported(checkpoint)
    assert repr(NAME) in str(caught.value) and str(checkpoint / DCP_METADATA_NAME) in str(caught.value)
    return message


@pytest.mark.parametrize(
    ("boxes", "reason"),
    [
        ([], "its chunks hold 0 of its 128 elements"),  # read as whatever memory held
        ([((0, 0), (15, 8))], "its chunks hold 120 of its 128 elements"),  # a row never read
        # 128 elements, but row 7 twice and row 15 never
        ([((0, 0), (8, 8)), ((7, 0), (8, 8))], r"the chunks at \(0, 0\) and \(7, 0\) overlap"),
        # row 9 twice, row 15 never: the overlap is with a chunk opened before the latest one
        (
            [((0, 0), (10, 4)), ((0, 4), (16, 4)), ((9, 0), (6, 4))],
            r"the chunks at \(0, 0\) and \(9, 0\) overlap",
        ),
        ([((1, 0), (16, 8))], r"the chunk at \(1, 0\) of size \(16, 8\) lies outside it"),
    ],
    ids=["no_chunks", "a_gap", "an_overlap_with_the_right_count", "an_overlap_past_an_open_chunk", "outside"],
)
def test_chunks_that_do_not_tile_their_tensor_are_refused(
    tmp_path: Path, boxes: list[tuple[tuple[int, int], tuple[int, int]]], reason: str
) -> None:
    checkpoint = retile(saved(tmp_path / "ckpt"), boxes)
    refused_on_both_paths(checkpoint, CorruptIndexError, reason)


def test_a_part_no_chunk_covers_would_export_as_zeros_not_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second line behind the chunk checks (bypassed here): the reader allocates zeros, so a part DCP never
    reads holds none of the process's memory (``torch.empty`` made to return memory holding 7s, as reused
    memory holds what was there before)."""
    checkpoint = retile(saved(tmp_path / "ckpt"), [((0, 0), (8, 8))])  # rows 8 to 15 never read
    monkeypatch.setattr(dcp_reader, "check_chunks", lambda *args: None)
    empty = torch.empty

    def used_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        return tensor.fill_(7.0) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", used_memory)
    weight = exported(checkpoint)[NAME]
    assert torch.equal(weight[:8], trained(seed=0)[0][0].weight[:8])
    assert torch.equal(weight[8:], torch.zeros(8, 8))


def test_a_chunk_beyond_its_stored_bytes_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """One chunk claiming a declared size far beyond what the files hold: the export would allocate it, and
    write it out, had the chunk's bytes not been compared with its storage first."""
    checkpoint = saved(tmp_path / "ckpt")

    def huge(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata[KEY]
        entry.size = torch.Size([2**14, 8])
        (index,) = [index for index in metadata.storage_data if index.fqn == KEY]
        entry.chunks = [ChunkStorageMetadata(index.offset, entry.size)]

    rewrite_metadata(checkpoint, huge)
    refused_on_both_paths(checkpoint, CorruptIndexError, r"the chunk at \(0, 0\) holds 524288 bytes, but")


def test_a_chunk_stored_in_fewer_bytes_than_it_holds_is_refused(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path / "ckpt")

    def short(metadata: Metadata) -> None:
        (index,) = [index for index in metadata.storage_data if index.fqn == KEY]
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], length=16)

    rewrite_metadata(checkpoint, short)
    refused_on_both_paths(checkpoint, CorruptIndexError, "holds 512 bytes, but .* stores it in 16")


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_metadata_naming_files_outside_the_checkpoint_is_refused(tmp_path: Path, where: str) -> None:
    """Every ``.distcp`` file moved out, ``.metadata`` pointing at it, the manifest agreeing (it lists only the
    files inside): the manifest would vouch for none of the bytes loaded."""
    checkpoint = saved(tmp_path / "ckpt")
    (shard,) = checkpoint.glob("*.distcp")
    outside = tmp_path / "outside" / shard.name
    outside.parent.mkdir()
    shard.rename(outside)
    relative = str(outside) if where == "absolute" else f"../outside/{shard.name}"

    def point_outside(metadata: Metadata) -> None:
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative)

    rewrite_metadata(checkpoint, point_outside, shard)
    message = failed_load(checkpoint, CorruptIndexError, "not a file name")
    assert repr(relative) in message and str(checkpoint / DCP_METADATA_NAME) in message
    with pytest.raises(CorruptIndexError, match="not a file name"):
        DCPReader(checkpoint)


# ------------------------------------------------------------------------- ranks agree on what one of them saw
def _load_after_rank_1s_share_is_damaged(root: str) -> str:
    import torch.distributed as dist

    checkpoint = Path(root) / "ckpt"
    module, optimizer = trained(seed=0)
    save(checkpoint, lightning_checkpoint(module, optimizer))
    if dist.get_rank() == 0:  # a file only rank 1 checksums (ranks split the sorted list)
        flip_a_byte(checkpoint / manifest.share(list(manifest.read_manifest(checkpoint)), 1, 2)[0])
    dist.barrier()
    try:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    except CorruptShardError as error:
        return str(error)
    return "loaded"


def test_every_rank_fails_when_one_rank_finds_damage(tmp_path: Path) -> None:
    ranks = run_distributed(_load_after_rank_1s_share_is_damaged, 2, str(tmp_path), timeout=120)
    assert all("CRC-32" in outcome for outcome in ranks), ranks
    assert ranks[0].startswith("rank 1: ")  # rank 0 names the rank that saw it


# ------------------------------------------------------------------------------------ choosing a checkpoint
def test_a_folder_resolves_to_the_newest_complete_checkpoint_and_logs_the_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "checkpoints"
    older = saved(folder / "step=2.ckpt", seed=0)
    newest_complete = saved(folder / "step=4.ckpt", seed=1)
    incomplete = saved(folder / "step=6.ckpt", seed=2)
    (incomplete / manifest.MANIFEST_NAME).unlink()
    truncated = saved(folder / "step=8.ckpt", seed=3)
    (shard,) = truncated.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    (folder / ".step=10.ckpt.tmp-0badf00d").mkdir()  # a save in flight or crashed: never a candidate
    os.utime(older / manifest.MANIFEST_NAME, (1e9, 1e9))
    module, optimizer = trained(seed=5)
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        load(folder, module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[0].weight, trained(seed=1)[0][0].weight)
    text = caplog.text
    assert f"resuming from {newest_complete}" in text
    assert f"skipping checkpoint {incomplete}" in text and "no manifest.json" in text
    assert f"skipping checkpoint {truncated}" in text and "has 10 bytes" in text
    assert str(older) not in text  # older than the chosen one: not considered, not logged


@pytest.mark.parametrize("damage", ["manifest_deleted", "bytes_flipped"])
def test_a_damaged_last_checkpoint_fails_naming_the_newest_complete_one(tmp_path: Path, damage: str) -> None:
    """What ``ckpt_path="last"`` resolves to (``last.ckpt``) is damaged: the error names it, and its note the
    newest other complete checkpoint of the folder and the ckpt_path that resumes from it."""
    folder = tmp_path / "checkpoints"
    saved(folder / "step=2.ckpt", seed=0)
    complete = saved(folder / "step=4.ckpt", seed=1)
    last = saved(folder / "last.ckpt", seed=2)
    os.utime(folder / "step=2.ckpt" / manifest.MANIFEST_NAME, (1e9, 1e9))
    if damage == "manifest_deleted":
        (last / manifest.MANIFEST_NAME).unlink()
    else:
        (shard,) = last.glob("*.distcp")
        flip_a_byte(shard)
    module, optimizer = trained(seed=5)
    before = snapshot(module, optimizer)
    error_type = MissingShardError if damage == "manifest_deleted" else CorruptShardError
    with pytest.raises(error_type, match=r"last\.ckpt") as caught:
        load(last, module, {0: optimizer}, strict=True, weights_only=True)
    assert_unchanged(before, module, optimizer)
    (note,) = caught.value.__notes__
    assert f"the newest other complete checkpoint in {folder} is step=4.ckpt" in note
    assert f"resume with ckpt_path={str(complete)!r}" in note
    load(complete, module, {0: optimizer}, strict=True, weights_only=True)  # the fix works
    assert torch.equal(module[0].weight, trained(seed=1)[0][0].weight)


def test_a_damaged_checkpoint_alone_in_its_folder_has_no_note(tmp_path: Path) -> None:
    last = saved(tmp_path / "checkpoints" / "last.ckpt")
    (last / manifest.MANIFEST_NAME).unlink()
    module, optimizer = trained(seed=5)
    with pytest.raises(MissingShardError) as caught:
        load(last, module, {0: optimizer}, strict=True, weights_only=True)
    assert not getattr(caught.value, "__notes__", [])


def test_a_folder_without_a_complete_checkpoint_fails_listing_why(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    incomplete = saved(folder / "step=2.ckpt")
    (incomplete / manifest.MANIFEST_NAME).unlink()
    module, optimizer = trained(seed=5)
    with pytest.raises(MissingShardError, match="holds no complete checkpoint") as caught:
        load(folder, module, {0: optimizer}, strict=True, weights_only=True)
    assert "step=2.ckpt: checkpoint" in str(caught.value)


def test_a_hugging_face_folder_as_ckpt_path_is_refused_naming_its_files_and_load_hf_weights(
    tmp_path: Path,
) -> None:
    """Starting from a model's weights and resuming a run mixed up: the error says which is which, the model
    untouched; a folder of checkpoints beside a config.json still resumes."""
    folder = tmp_path / "qwen3-0.6b"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes(b"")
    module, optimizer = trained(seed=5)
    before = snapshot(module, optimizer)
    with pytest.raises(CheckpointError) as caught:
        load(folder, module, {0: optimizer}, strict=True, weights_only=True)
    assert_unchanged(before, module, optimizer)
    message = str(caught.value)
    assert message.startswith(f"ckpt_path {str(folder)!r} is a Hugging Face model, not a training checkpoint")
    assert "(it holds config.json, model.safetensors; no meta.pt or .metadata)" in message
    assert f"loaded with the LoadHFWeights({str(folder)!r}) callback" in message
    assert "ckpt_path is for training checkpoints" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    # the weights file alone: the strategy refuses it before Lightning's loader of checkpoint files reads it
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_d9d import D9DStrategy

    strategy = D9DStrategy()
    strategy.connect(BoringModel())
    weights = folder / "model.safetensors"
    with pytest.raises(
        CheckpointError, match=re.escape(f"ckpt_path {str(weights)!r} is a Hugging Face model")
    ):
        strategy.load_checkpoint(weights)
    # a run's folder holding a config of its own beside its checkpoints is a folder of checkpoints
    runs = tmp_path / "run"
    saved(runs / "step=2.ckpt", seed=1)
    (runs / "config.json").write_text("{}")
    load(runs, module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[0].weight, trained(seed=1)[0][0].weight)


def test_the_only_complete_checkpoint_is_kept(tmp_path: Path) -> None:
    only = saved(tmp_path / "step=2.ckpt")
    incomplete = saved(tmp_path / "step=4.ckpt")
    (incomplete / manifest.MANIFEST_NAME).unlink()
    assert selection.keep_reason(only) is not None
    assert selection.keep_reason(incomplete) is None
    saved(tmp_path / "step=6.ckpt")
    assert selection.keep_reason(only) is None


def test_the_strategy_does_not_remove_the_only_complete_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_d9d import D9DStrategy

    strategy = D9DStrategy()  # what ModelCheckpoint calls for save_top_k / keep-last-N
    only = saved(tmp_path / "step=2.ckpt")
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        strategy.remove_checkpoint(only)
    assert only.is_dir() and f"not deleting {only}: {only} is the only complete checkpoint" in caplog.text
    saved(tmp_path / "step=4.ckpt")
    strategy.remove_checkpoint(only)
    assert not only.exists()


def test_pieces_are_checksummed_in_parallel_and_the_damaged_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest, "PIECE_BYTES", 256)  # many pieces in a small shard
    checkpoint = saved(tmp_path / "ckpt")
    (shard,) = checkpoint.glob("*.distcp")
    pieces = manifest.read_manifest(checkpoint)[shard.name].crc32
    assert len(pieces) == -(-shard.stat().st_size // 256) > 4
    content = bytearray(shard.read_bytes())
    content[3 * 256 + 7] ^= 0x01  # one bit in the fourth piece
    shard.write_bytes(bytes(content))
    assert str(shard) in failed_load(checkpoint, CorruptShardError, "its bytes 768 to 1024 does not match")


# ------------------------------------------------------------------------------------ random-number states
def _draws_after_resume(root: str) -> tuple[list[float], list[float]]:
    """Each rank draws from torch, Python and NumPy right after a save and right after loading it back, with
    its generators reseeded in between (as a fresh run would be)."""
    import random

    import numpy as np
    import torch.distributed as dist

    def draws() -> list[float]:
        return [float(torch.rand(())), random.random(), float(np.random.rand())]

    rank = dist.get_rank()
    torch.manual_seed(100 + rank), random.seed(200 + rank), np.random.seed(300 + rank)
    module, optimizer = trained(seed=0)
    save(Path(root) / "ckpt", lightning_checkpoint(module, optimizer))
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # a fresh run's seeds: the same on every rank
    load(Path(root) / "ckpt", module, {0: optimizer}, strict=True, weights_only=True)
    return expected, draws()


def test_every_ranks_random_states_come_back(tmp_path: Path) -> None:
    ranks = run_distributed(_draws_after_resume, 2, str(tmp_path), timeout=120)
    for expected, resumed in ranks:
        assert resumed == expected
    assert ranks[0][0] != ranks[1][0]  # the ranks' streams differ, and each got its own back


# ------------------------------------------------------------------------ a rank failing in ShardedWriter
def _one_rank_fails_while_writing(root: str) -> tuple[str, float]:
    import torch.distributed as dist

    from lightning_d9d.state import ShardedWriter

    start = time.perf_counter()
    try:
        with ShardedWriter(Path(root) / "hf", distributed=True) as writer:
            writer.add(f"w{dist.get_rank()}", torch.ones(4))
            if dist.get_rank() == 1:
                raise OSError("rank 1 ran out of memory")
        outcome = "committed"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    return outcome, time.perf_counter() - start


def test_a_rank_failing_inside_sharded_writer_fails_every_rank_promptly(tmp_path: Path) -> None:
    ranks = run_distributed(_one_rank_fails_while_writing, 2, str(tmp_path), timeout=30)
    (rank0, seconds0), (rank1, _) = ranks
    assert rank1 == "OSError: rank 1 ran out of memory"
    assert "failed on rank 1" in rank0 and "rank 1 ran out of memory" in rank0, rank0
    assert seconds0 < 10
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no temporary directory left


# ------------------------------------------------------------------------ two jobs saving to one path
def test_a_save_removes_only_temporary_directories_whose_save_is_over(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(finished.stdout)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        entries = {
            "dead": f".ckpt.tmp-{host}-{dead_pid}-00000001",  # its process is gone: a crashed save
            "running": f".ckpt.tmp-{host}-{running.pid}-00000002",  # another job saving right now
            "other_host_recent": ".ckpt.tmp-node-7.cluster-4242-00000003",
            "other_host_old": ".ckpt.tmp-node-8.cluster-4242-00000004",
        }
        for name in entries.values():
            (tmp_path / name).mkdir()
        os.utime(tmp_path / entries["other_host_old"], (1e9, 1e9))
        saved(tmp_path / "ckpt")
    finally:
        running.kill()
        running.wait()
    left = {path.name for path in tmp_path.iterdir()}
    assert left == {"ckpt", entries["running"], entries["other_host_recent"]}


def craft_bytes_entry(checkpoint: Path, payload: object) -> str:
    """Point one non-tensor ("bytes") entry of ``checkpoint`` at a pickle of ``payload`` appended to its shard,
    and make ``.metadata`` and the manifest agree, as a crafted checkpoint would. Returns the entry's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(checkpoint / DCP_METADATA_NAME)
    name = next(
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata) and key.endswith(".lr")
    )
    index = next(index for index in metadata.storage_data if index.fqn == name)
    info = metadata.storage_data[index]
    shard = checkpoint / info.relative_path
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        file.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    write_metadata_pickle(checkpoint, pickle.dumps(metadata), shard)
    return name


def test_a_crafted_bytes_entry_is_refused_without_running_it(tmp_path: Path) -> None:
    """DCP's default planner unpickles non-tensor entries (the optimizer's lr, betas, ...) with
    ``weights_only=False``: ours refuses anything but plain values, naming the entry."""
    checkpoint = saved(tmp_path / "ckpt")
    Payload.mark = tmp_path / "was_run"
    name = craft_bytes_entry(checkpoint, Payload())
    message = failed_load(checkpoint, CorruptIndexError, "refusing to unpickle")
    assert repr(name) in message and str(checkpoint) in message
    assert not Payload.mark.exists()


def test_a_plain_bytes_entry_still_loads(tmp_path: Path) -> None:
    """The planner's own path for bytes entries, checked by a value only the crafted entry holds."""
    checkpoint = saved(tmp_path / "ckpt")
    craft_bytes_entry(checkpoint, 0.125)
    module, optimizer = trained(seed=1)
    load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert [group["lr"] for group in optimizer.param_groups] == [0.125]
