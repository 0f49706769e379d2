"""Checkpoint ↔ module ↔ checkpoint, streamed through a mapper: ``load_into_module``, ``save_from_module``,
``convert``.

A mapper always points the way the data flows: to save with the graph you load with, pass ``mapper.inverse()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

from .compose import Sequential
from .dtensor import Gather, distribute_full, is_dtensor
from .errors import CheckpointError, ShapeMismatchError
from .graph import check_coverage
from .mapper import ModelStateMapper
from .reader import DEFAULT_HANDLE_BUDGET_BYTES, CheckpointReader, GroupResult
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter


def _copy_into(target: Tensor, key: str, value: Tensor, result: GroupResult) -> None:
    """Copy a full tensor into a parameter or buffer; for a DTensor, only this rank's shard of it."""
    # A DTensor's shape is the global one, so this compares against the full tensor on every rank.
    expected_shape, found_shape = tuple(target.shape), tuple(value.shape)
    if expected_shape != found_shape or target.dtype != value.dtype:
        raise ShapeMismatchError(
            f"{key!r}: the module expects shape {expected_shape} {target.dtype}, the checkpoint gives "
            f"{found_shape} {value.dtype} (read from {result.origin()})"
            + (" (a Cast in the mapper converts dtypes)" if expected_shape == found_shape else ""),
            key=key,
        )
    if target.is_meta:
        raise CheckpointError(
            f"{key!r} is on the meta device: materialise the module (to_empty) before loading"
        )
    if is_dtensor(target):
        local = distribute_full(value, target.device_mesh, target.placements).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(value)


def load_into_module(
    module: nn.Module,
    directory: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    handle_budget_bytes: int = DEFAULT_HANDLE_BUDGET_BYTES,
) -> None:
    """Stream the checkpoint in ``directory`` through ``mapper`` (disk → module) into ``module``'s parameters and
    persistent buffers, in place.

    ``mapper`` must read exactly the checkpoint's keys and write exactly ``module.state_dict()``'s keys; a
    mismatch is reported by name before anything is read. DTensor parameters (FSDP2, TP) receive only their
    local shard: every rank reads the full tensors and slices them, with no communication. Shapes and dtypes
    must match exactly.
    """
    targets = module.state_dict(keep_vars=True)
    reader = CheckpointReader(directory, handle_budget_bytes=handle_budget_bytes)
    with torch.no_grad():
        for result in reader.stream(
            mapper, target_keys=targets, target_name=f"{type(module).__name__}.state_dict()"
        ):
            for key in result.group.outputs:
                _copy_into(targets[key], key, result.outputs[key], result)
            del result  # free this group before the next one is read


def _write_all(writer: ShardedWriter, outputs: Mapping[str, Tensor]) -> None:
    # A function of its own so that no loop variable outlives the group (an unstacked view pins its base).
    for key, value in outputs.items():
        writer.add(key, value)


def _is_writer_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_from_module(
    module: nn.Module,
    directory: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Stream ``module.state_dict()`` through ``mapper`` (module → disk) into a checkpoint at ``directory``.

    DTensors are gathered with ``full_tensor()`` group by group, only when a group needs them: peak memory is
    one group plus one shard, not the model. In a multi-rank run every rank must call this (gathering is a
    collective, done in the same group order everywhere); only rank 0 writes, and all ranks return once the
    checkpoint is in place. If a rank fails midway the others wait in the next collective until the process
    group times out; the destination is then left as it was.
    """
    import torch.distributed as dist

    state = module.state_dict()
    check_coverage(
        mapper, source_keys=state, source_name=f"{type(module).__name__}.state_dict()", target_name="disk"
    )
    dtensor_keys = [key for key, value in state.items() if is_dtensor(value)]
    graph = Sequential([Gather(dtensor_keys), mapper]) if dtensor_keys else mapper
    order = {key: position for position, key in enumerate(state)}
    # state_dict order is the same on every rank, so every rank gathers the same tensors in the same order.
    groups = sorted(graph.groups(), key=lambda group: min(order[key] for key in group.inputs))
    writes = _is_writer_rank()
    writer = ShardedWriter(directory, max_shard_bytes=max_shard_bytes, metadata=metadata) if writes else None
    with torch.no_grad(), writer if writer is not None else nullcontext():
        for group in groups:
            outputs = graph.consume({key: state[key] for key in group.inputs})
            if writer is not None:
                _write_all(writer, outputs)
            del outputs
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the checkpoint is complete on disk before any rank goes on to read it
    return Path(directory).absolute()


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
    handle_budget_bytes: int = DEFAULT_HANDLE_BUDGET_BYTES,
) -> Path:
    """Disk → disk through ``mapper``; peak memory is about one group plus one shard.

    ``destination`` may equal ``source``: everything is read before the new directory replaces the old one.
    """
    reader = CheckpointReader(source, handle_budget_bytes=handle_budget_bytes)
    with ShardedWriter(destination, max_shard_bytes=max_shard_bytes, metadata=metadata) as writer:
        for result in reader.stream(mapper, target_name=str(destination)):
            _write_all(writer, result.outputs)
            del result  # free this group before the next one is read
    return writer.directory
