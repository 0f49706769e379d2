"""Sharded training checkpoints through ``torch.distributed.checkpoint``, written atomically.

Layout (the same as Lightning's ``ModelParallelStrategy``, so its tools still read it): a directory holding
the DCP files of ``{"state_dict": ..., "optimizer_0": ...}`` and ``meta.pt`` with everything else (loops,
callbacks, hyper-parameters). Optimizer state is flattened (``state.<fqn>.exp_avg``) so that every pipeline
stage's entries survive DCP's de-duplication of non-tensor values.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

METADATA_FILENAME = "meta.pt"
DCP_METADATA_FILENAME = ".metadata"
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_OPTIONS)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def replace_atomically(new: Path, final: Path) -> None:
    """Move the finished ``new`` to ``final``; an existing ``final`` is removed only after the move."""
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        final.rename(old)
    new.rename(final)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def temporary_sibling(final: Path, token: str) -> Path:
    return final.with_name(f".{final.name}.tmp-{token}")


def save_sharded(
    path: Path,
    checkpoint: dict[str, Any],
    *,
    rank: int,
    token: str,
    barrier: Callable[[], None],
) -> None:
    """Write ``checkpoint`` to ``path`` (all ranks call it); the directory appears only once it is complete."""
    tmp = temporary_sibling(path, token)
    if rank == 0:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update(
        {f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}
    )
    dcp.save(tensors, checkpoint_id=tmp)
    if rank == 0:
        torch.save(checkpoint, tmp / METADATA_FILENAME)
    barrier()
    if rank == 0:
        replace_atomically(tmp, path)
    barrier()


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; check ckpt_path")
    for name in (METADATA_FILENAME, DCP_METADATA_FILENAME):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} is incomplete: {name} is missing. It was not written by the d9d "
                "strategy, or its save was interrupted; choose another checkpoint."
            )


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Mapping[int, Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Load model and optimizer state in place (any mesh: DCP reshards) and return the remaining metadata."""
    _check_readable(path)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    state.update({f"optimizer_{i}": optimizer_state(module, opt) for i, opt in optimizers.items()})
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in optimizers.items():
        set_optimizer_state_dict(
            module, opt, optim_state_dict=state[f"optimizer_{i}"], options=OPTIMIZER_OPTIONS
        )
    metadata: dict[str, Any] = torch.load(path / METADATA_FILENAME, weights_only=weights_only)
    return metadata
