"""The training checkpoint (``lightning_d9d.state.training``): what a save may replace, failed and crashed saves,
durability, and loads that check every file before they touch the model."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

import lightning_d9d.state.atomic as atomic
import lightning_d9d.state.manifest as manifest
import lightning_d9d.state.training as training
from lightning_d9d.state import CheckpointError, CheckpointFileError, CorruptShardError
from lightning_d9d.state.training import META_NAME, load, optimizer_state, save


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Iterator[None]:
    # dcp.save/load announce that they run without a process group, which these tests do on purpose.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A module and an Adam optimizer with state (one step taken), different for each seed."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    return module, optimizer


def lightning_checkpoint(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What Lightning hands the strategy: the model state, the optimizer states, and everything else."""
    return {
        "state_dict": {key: value.detach().clone() for key, value in module.state_dict().items()},
        "optimizer_states": [optimizer_state(module, optimizer)],
        "epoch": 3,
        "callbacks": {"LoadHFWeights{'path': 'x'}": {"hf_config": {"model_type": "qwen3"}}},
    }


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"param.{key}": value.detach().clone() for key, value in module.state_dict().items()}
    for position, per_param in optimizer.state_dict()["state"].items():
        for name, value in per_param.items():
            state[f"optim.{position}.{name}"] = torch.as_tensor(value).clone()
    return state


def assert_unchanged(
    before: dict[str, torch.Tensor], module: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    after = snapshot(module, optimizer)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} was changed by a load that failed"


def entries(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


# ---------------------------------------------------------------------------------------- round trip
def test_round_trip_restores_model_optimizer_and_meta(tmp_path: Path) -> None:
    module, optimizer = trained(seed=0)
    save(tmp_path / "step=4.ckpt", lightning_checkpoint(module, optimizer))
    expected = snapshot(module, optimizer)
    other, other_optimizer = trained(seed=1)
    assert not torch.equal(other[0].weight, module[0].weight)

    meta = load(tmp_path / "step=4.ckpt", other, {0: other_optimizer}, strict=True, weights_only=True)

    assert_unchanged(expected, other, other_optimizer)  # i.e. now equal to the saved module's
    assert meta["epoch"] == 3 and training.recorded_hf_config(meta) == {"model_type": "qwen3"}
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert entries(tmp_path) == ["step=4.ckpt"]


def test_paths_in_the_hyperparameters_load_without_unpickling_anything_else(tmp_path: Path) -> None:
    """A LightningModule's hyperparameters often hold a ``Path`` (a model folder): ``meta.pt`` loads it under
    ``weights_only``; other classes stay refused (the checkpoint tests of untrusted input)."""
    module, optimizer = trained(seed=0)
    checkpoint = lightning_checkpoint(module, optimizer)
    checkpoint["hyper_parameters"] = {"folder": Path("models/qwen3"), "pure": PurePosixPath("a/b")}
    save(tmp_path / "step=4.ckpt", checkpoint)
    meta = load(tmp_path / "step=4.ckpt", module, {0: optimizer}, strict=True, weights_only=True)
    assert meta["hyper_parameters"] == {"folder": Path("models/qwen3"), "pure": PurePosixPath("a/b")}


def test_a_background_save_checksums_off_the_calling_thread_and_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CRC pass over every file is as long as the write; in the training thread it cost what the background
    # write saved (measured on the H200, docs/benchmarks.md): it runs after the write, in the background too
    threads: list[str] = []
    checksum = manifest.checksum

    def recording_checksum(path: Path) -> manifest.FileEntry:
        if path.name != META_NAME:  # meta.pt is written and checksummed by finish, in the caller
            threads.append(threading.current_thread().name)
        return checksum(path)

    monkeypatch.setattr(manifest, "checksum", recording_checksum)
    module, optimizer = trained(seed=0)
    expected = snapshot(module, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # DCP: no process group, "assuming the intent is to save in a single process"
        pending = training.save_async(tmp_path / "step=4.ckpt", lightning_checkpoint(module, optimizer), None)
        assert not (tmp_path / "step=4.ckpt").exists()  # not under its name before finish
        pending.wait()
        assert threads and all(name != threading.main_thread().name for name in threads), threads
        pending.finish()
        other, other_optimizer = trained(seed=1)
        load(tmp_path / "step=4.ckpt", other, {0: other_optimizer}, strict=True, weights_only=True)
    assert_unchanged(expected, other, other_optimizer)


# -------------------------------------------------------------------------- D1: what a save may replace
def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    module, optimizer = trained(seed=0)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointFileError, match="refusing to replace") as caught:
        save(home, lightning_checkpoint(module, optimizer))
    assert str(home) in str(caught.value)
    assert (home / "notes.txt").read_text() == "precious"
    assert entries(home) == ["notes.txt"]
    assert entries(tmp_path) == ["home"]  # and no temporary directory left beside it


def lightning_checkpoint_file(path: Path, **extra: Any) -> None:
    """A checkpoint file as Lightning writes one (``torch.save`` of the Trainer's checkpoint dict), as
    ``save_distributed_checkpoint=False`` or another strategy leaves ``last.ckpt``."""
    torch.save(
        {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.0", "state_dict": {}, **extra}, path
    )


def test_save_replaces_a_checkpoint_of_ours_and_a_checkpoint_file(tmp_path: Path) -> None:
    first, first_optimizer = trained(seed=0)
    second, second_optimizer = trained(seed=1)
    target = tmp_path / "last.ckpt"
    lightning_checkpoint_file(target)
    save(target, lightning_checkpoint(first, first_optimizer))
    assert target.is_dir()
    save(target, lightning_checkpoint(second, second_optimizer))
    module, optimizer = trained(seed=2)
    load(target, module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[2].weight, second[2].weight)
    assert entries(tmp_path) == ["last.ckpt"]


class Mark:
    """What a pickle would run if the file were unpickled: here it only leaves a mark."""

    path = Path()

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(Mark.path),))


def test_recognising_a_checkpoint_file_runs_nothing_in_it(tmp_path: Path) -> None:
    Mark.path = tmp_path / "was_run"
    target = tmp_path / "last.ckpt"
    lightning_checkpoint_file(target, payload=Mark())
    module, optimizer = trained(seed=0)
    save(target, lightning_checkpoint(module, optimizer))
    assert target.is_dir() and not Mark.path.exists()


def _torch_file(path: Path) -> None:
    torch.save({"embeddings": torch.ones(3)}, path)  # a torch file, but not a checkpoint Lightning wrote


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("data.bin", lambda path: path.write_bytes(b"a corpus")),
        ("last.ckpt", lambda path: path.write_bytes(b"not a zip, whatever its name")),
        ("embeddings.pt", _torch_file),
        ("last.ckpt", _torch_file),
    ],
    ids=["data", "named_ckpt", "torch_file", "torch_file_named_ckpt"],
)
def test_save_refuses_to_replace_a_file_that_is_not_a_checkpoint_file(
    tmp_path: Path, name: str, write: Callable[[Path], Any]
) -> None:
    target = tmp_path / name
    write(target)
    content = target.read_bytes()
    module, optimizer = trained(seed=0)
    with pytest.raises(CheckpointFileError, match="refusing to replace") as caught:
        save(target, lightning_checkpoint(module, optimizer))
    assert str(target) in str(caught.value) and "Move it away or choose another path" in str(caught.value)
    assert target.read_bytes() == content
    assert entries(tmp_path) == [name]  # and no temporary directory left beside it


# -------------------------------------------------------------------- D2: crashed saves, durability
def test_save_cleans_up_after_crashed_saves(tmp_path: Path) -> None:
    module, optimizer = trained(seed=0)
    target = tmp_path / "step=4.ckpt"
    save(target, lightning_checkpoint(module, optimizer))
    # A save that crashed while writing, and one that crashed after the new checkpoint was renamed in.
    (tmp_path / ".step=4.ckpt.tmp-0badf00d").mkdir()
    (tmp_path / ".step=4.ckpt.tmp-0badf00d" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".step=4.ckpt.old-0badf00d").mkdir()
    (tmp_path / ".other.ckpt.tmp-12345678").mkdir()  # another target's: not ours to touch
    save(target, lightning_checkpoint(module, optimizer))
    assert entries(tmp_path) == [".other.ckpt.tmp-12345678", "step=4.ckpt"]


def test_save_recovers_the_old_checkpoint_after_a_crash_between_the_renames(tmp_path: Path) -> None:
    old, old_optimizer = trained(seed=0)
    target = tmp_path / "last.ckpt"
    save(target, lightning_checkpoint(old, old_optimizer))
    os.rename(target, tmp_path / ".last.ckpt.old-0badf00d")  # renamed aside, then the job died
    module, optimizer = trained(seed=1)
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint is .*\.last\.ckpt\.old-0badf00d"):
        load(target, module, {0: optimizer}, strict=True, weights_only=True)
    # The next save puts the old checkpoint back first; this one then fails, leaving it in place.
    failing = lightning_checkpoint(old, old_optimizer)
    failing["unpicklable"] = lambda: None  # torch.save of meta.pt fails, after the DCP files are written
    with pytest.raises(Exception, match="pickle"):
        save(target, failing)
    assert entries(tmp_path) == ["last.ckpt"]
    load(target, module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[0].weight, old[0].weight)


def test_save_fsyncs_meta_the_directory_and_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))  # what the descriptor is open on (Linux)
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    module, optimizer = trained(seed=0)
    save(tmp_path / "ckpt", lightning_checkpoint(module, optimizer))
    temporary = {path.parent for path in synced if path.name == META_NAME}
    assert len(temporary) == 1, synced  # meta.pt, written in the temporary directory
    (directory,) = temporary
    assert directory.name.startswith(".ckpt.tmp-")
    assert directory in synced  # its entries, before the rename
    assert synced[-1] == tmp_path  # the rename itself is made durable last


# ---------------------------------------------------------------- D2: failures agreed across two ranks
def _failing_saves(root: str) -> dict[str, Any]:
    """On two gloo ranks: each scenario injects one failure; report what each rank raised and how fast."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    rank = dist.get_rank()
    module, optimizer = trained(seed=0)
    report: dict[str, Any] = {}

    def attempt(name: str, target: Path) -> None:
        start = time.perf_counter()
        try:
            save(target, lightning_checkpoint(module, optimizer))
            outcome = "saved"
        except BaseException as error:
            outcome = f"{type(error).__name__}: {error}"
        report[name] = (outcome, time.perf_counter() - start)
        dist.barrier()  # the next scenario starts together

    # rank 0 cannot write meta.pt
    real_save = torch.save
    if rank == 0:

        def save_but_meta(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
            if Path(str(file)).name == META_NAME:
                raise OSError("disk full")
            real_save(obj, file, *args, **kwargs)

        torch.save = save_but_meta
    attempt("meta", Path(root) / "meta.ckpt")
    torch.save = real_save

    # rank 0 cannot rename the finished directory over an existing checkpoint
    attempt("first", Path(root) / "existing.ckpt")
    real_rename = atomic.os.rename
    if rank == 0:

        def rename(source: Any, target: Any) -> None:
            if Path(source).name.startswith(".existing.ckpt.tmp-"):
                raise PermissionError(f"cannot rename {source}")
            real_rename(source, target)

        atomic.os.rename = rename  # type: ignore[assignment]
    attempt("rename", Path(root) / "existing.ckpt")
    atomic.os.rename = real_rename  # type: ignore[assignment]

    # rank 1 cannot write its DCP files
    real_write = FileSystemWriter.write_data
    if rank == 1:

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("rank 1 lost its disk")

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    attempt("dcp", Path(root) / "dcp.ckpt")
    FileSystemWriter.write_data = real_write  # type: ignore[method-assign]
    return report


def test_failed_saves_raise_promptly_on_every_rank_and_leave_nothing_behind(tmp_path: Path) -> None:
    ranks = run_distributed(_failing_saves, 2, str(tmp_path), timeout=120)
    for rank, report in enumerate(ranks):
        for scenario in ("meta", "rename", "dcp"):
            outcome, seconds = report[scenario]
            assert outcome != "saved", (rank, scenario)
            assert seconds < 10, f"rank {rank} took {seconds:.1f} s to learn that {scenario!r} failed"
        assert report["first"][0] == "saved"
    assert "disk full" in ranks[0]["meta"][0] and "disk full" in ranks[1]["meta"][0]
    assert "on rank 0" in ranks[1]["meta"][0] and "on rank 0" in ranks[1]["rename"][0]
    assert "cannot rename" in ranks[1]["rename"][0]
    for report in ranks:  # DCP's own error, with the failed rank and its reason, on both ranks
        assert (
            report["dcp"][0].startswith("CheckpointFileError") and "failed on ranks [1]" in report["dcp"][0]
        )
        assert "rank 1 lost its disk" in report["dcp"][0]
    assert entries(tmp_path) == ["existing.ckpt"]  # no temporary directory, no half checkpoint
    module, optimizer = trained(seed=5)
    load(tmp_path / "existing.ckpt", module, {0: optimizer}, strict=True, weights_only=True)
    assert torch.equal(module[0].weight, trained(seed=0)[0][0].weight)  # the first save is intact


# ---------------------------------------------------------------- D3: loads check files before the model
@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    module, optimizer = trained(seed=0)
    save(tmp_path / "ckpt", lightning_checkpoint(module, optimizer))
    return tmp_path / "ckpt"


def truncate(path: Path, fraction: float) -> None:
    content = path.read_bytes()
    path.write_bytes(content[: int(len(content) * fraction)])


def agreeing_manifest(checkpoint: Path) -> None:
    """Rewrite the manifest to match the damaged files: the checks behind it must still catch the damage."""
    names = [entry.name for entry in checkpoint.iterdir() if entry.name != manifest.MANIFEST_NAME]
    manifest.write_manifest(checkpoint, {name: manifest.checksum(checkpoint / name) for name in names})


def test_a_truncated_meta_pt_fails_naming_it_before_the_model_is_touched(checkpoint: Path) -> None:
    truncate(checkpoint / META_NAME, 0.5)
    module, optimizer = trained(seed=1)
    before = snapshot(module, optimizer)
    with pytest.raises(CorruptShardError, match=r"manifest\.json lists") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(checkpoint / META_NAME) in str(caught.value)
    agreeing_manifest(checkpoint)
    with pytest.raises(CheckpointFileError, match="cannot be read") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(checkpoint / META_NAME) in str(caught.value)
    assert_unchanged(before, module, optimizer)


def test_a_truncated_distcp_fails_naming_it_before_the_model_is_touched(checkpoint: Path) -> None:
    (data,) = checkpoint.glob("*.distcp")
    truncate(data, 0.6)
    module, optimizer = trained(seed=1)
    before = snapshot(module, optimizer)
    with pytest.raises(CorruptShardError, match=r"manifest\.json lists") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(data) in str(caught.value)
    agreeing_manifest(checkpoint)
    with pytest.raises(CorruptShardError, match="is truncated") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(data) in str(caught.value)
    assert_unchanged(before, module, optimizer)
    data.unlink()
    with pytest.raises(CheckpointFileError, match=r"listed in its manifest\.json, does not exist") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(data) in str(caught.value)
    agreeing_manifest(checkpoint)
    with pytest.raises(CheckpointFileError, match="which does not exist") as caught:
        load(checkpoint, module, {0: optimizer}, strict=True, weights_only=True)
    assert str(data) in str(caught.value)
    assert_unchanged(before, module, optimizer)


def test_a_checkpoint_without_the_optimizer_state_fails_naming_the_section(tmp_path: Path) -> None:
    module, optimizer = trained(seed=0)
    weights_only = lightning_checkpoint(module, optimizer)
    del weights_only["optimizer_states"]
    save(tmp_path / "ckpt", weights_only)
    other, other_optimizer = trained(seed=1)
    before = snapshot(other, other_optimizer)
    with pytest.raises(CheckpointError, match="no 'optimizer_0' entries"):
        load(tmp_path / "ckpt", other, {0: other_optimizer}, strict=True, weights_only=True)
    assert_unchanged(before, other, other_optimizer)
    load(tmp_path / "ckpt", other, {}, strict=True, weights_only=True)  # e.g. trainer.validate(ckpt_path=...)
    assert torch.equal(other[0].weight, module[0].weight)
