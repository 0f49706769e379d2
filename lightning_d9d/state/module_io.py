"""Checkpoint ↔ module ↔ checkpoint, streamed through a mapper: ``load_into_module``, ``save_from_module``,
``convert``.

A mapper always points the way the data flows: to save with the graph you load with, pass ``mapper.inverse()``.

Tied weights (one Parameter under two names, e.g. an LM head sharing the embedding) count once, under the name
``state_dict()`` lists first: a mapper writes (loads) or reads (saves) that name only. This is also what Hugging
Face files of tied models hold (no ``lm_head.weight``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from .compose import Sequential, Subset
from .dtensor import Gather, distribute_full, is_dtensor
from .errors import CheckpointError, ShapeMismatchError
from .graph import check_coverage
from .mapper import ModelStateMapper
from .reader import CheckpointReader, GroupResult
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter


def tied_aliases(state: Mapping[str, Tensor]) -> dict[str, str]:
    """``{alias: name}`` for the entries of ``state`` (a ``state_dict(keep_vars=True)``) that are the very tensor
    of an earlier entry, as tied weights are."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, value in state.items():
        name = first.setdefault(id(value), key)
        if name != key:
            aliases[key] = name
    return aliases


def module_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The module's parameters and persistent buffers by state-dict name, each tensor once, and the aliases left
    out (``{alias: name}``). Values are the live Parameters (DTensors under FSDP/TP), not copies."""
    # keep_vars=True: without it every entry is a fresh detached tensor, and ties could not be recognised.
    state = module.state_dict(keep_vars=True)
    aliases = tied_aliases(state)
    return {key: value for key, value in state.items() if key not in aliases}, aliases


def _describe(module: nn.Module, aliases: Mapping[str, str]) -> str:
    name = f"{type(module).__name__}.state_dict()"
    if aliases:
        tied = ", ".join(f"{alias!r} is {key!r}" for alias, key in aliases.items())
        name += f" (tied weights count once: {tied})"
    return name


def _copy_into(target: Tensor, key: str, value: Tensor, result: GroupResult, cast: bool) -> None:
    """Copy a full tensor into a parameter or buffer; for a DTensor, only this rank's shard of it."""
    # A DTensor's shape is the global one, so this compares against the full tensor on every rank.
    expected_shape, found_shape = tuple(target.shape), tuple(value.shape)
    castable = cast and target.is_floating_point() and value.is_floating_point()
    if expected_shape != found_shape or (target.dtype != value.dtype and not castable):
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
        target.to_local().copy_(local)  # copy_ converts the dtype where ``cast`` allowed a difference
    else:
        target.copy_(value)


def load_into_module(
    module: nn.Module,
    directory: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    cast: bool = False,
    partial: bool = False,
    leave: Collection[str] = (),
) -> None:
    """Stream the checkpoint in ``directory`` through ``mapper`` (disk → module) into ``module``'s parameters and
    persistent buffers, in place.

    ``mapper`` must read exactly the checkpoint's keys and write exactly ``module.state_dict()``'s keys, tied
    weights once (see the module docstring); a mismatch is reported by name before anything is read. With
    ``partial`` the module may hold only part of them (a pipeline stage): the groups that write its keys are read,
    the others are not (the checkpoint must still match the whole graph). DTensor parameters (FSDP2, TP) receive
    only their local shard: every rank reads the full tensors of one group at a time and keeps its slice, with no
    communication. Shapes must match exactly; dtypes too, unless ``cast`` (floating-point tensors are then
    converted to the parameter's dtype, e.g. a bf16 file into fp32 master weights). ``leave``: module keys the
    format does not cover, kept as they are (state our code added to a model, such as a router's selection bias).
    """
    targets, aliases = module_tensors(module)
    targets = {key: value for key, value in targets.items() if key not in leave}
    reader = CheckpointReader(directory)
    ignore: frozenset[str] = frozenset()
    if partial:
        check_coverage(mapper, source_keys=reader.keys(), source_name=f"checkpoint {reader.name}")
        mapper = Subset(mapper, targets, side="outputs")
        ignore = reader.keys() - mapper.input_keys()
    with torch.no_grad():
        for result in reader.stream(
            mapper, target_keys=targets, target_name=_describe(module, aliases), ignore=ignore
        ):
            for key in result.group.outputs:
                _copy_into(targets[key], key, result.outputs[key], result, cast)
            del result  # free this group before the next one is read


def _write_all(writer: ShardedWriter, outputs: Mapping[str, Tensor]) -> None:
    # A function of its own so that no loop variable outlives the group (an unstacked view pins its base).
    for key, value in outputs.items():
        writer.add(key, value)


def _holders(keys: Iterable[str]) -> tuple[list[frozenset[str]], int]:
    """Every rank's keys (one ``all_gather_object``) and this rank; just ours outside a multi-rank run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [frozenset(keys)], 0
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return [frozenset(held or ()) for held in gathered], dist.get_rank()


def save_from_module(
    module: nn.Module,
    directory: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    partial: bool = False,
    leave: Collection[str] = (),
    single_file: str | None = None,
) -> Path:
    """Stream ``module.state_dict()`` through ``mapper`` (module → disk) into a checkpoint at ``directory``.

    ``mapper`` reads the module's keys, tied weights once (see the module docstring). DTensors are gathered with
    ``full_tensor()`` group by group, only when a group needs them: peak memory is one group plus one shard, not
    the model. In a multi-rank run every rank must call this (gathering is a collective, done in the same group
    order by the ranks that share a tensor); each group is written by the lowest rank that holds it (rank 0,
    unless the ranks hold different parts of the model), and all ranks return once the checkpoint is in place.
    With ``partial`` each rank's module may hold only part of the graph's keys (a pipeline stage); together the
    ranks must hold all of them. If a rank fails midway the others wait in the next collective until the process
    group times out; the destination is then left as it was. ``extra_files`` (name → content, e.g.
    ``config.json``) are committed with the weights. ``leave``: module keys the format does not cover, not written.
    ``single_file``: every tensor in one file of that name, no index (``ShardedWriter``'s).
    """
    live, aliases = module_tensors(module)
    state = {key: value.detach() for key, value in live.items() if key not in leave}
    del live
    held, rank = _holders(state)
    if partial:
        union = frozenset().union(*held)
        check_coverage(
            mapper, source_keys=union, source_name="the modules of all ranks together", target_name="disk"
        )
        mapper = Subset(mapper, state, side="inputs")
    else:
        check_coverage(mapper, source_keys=state, source_name=_describe(module, aliases), target_name="disk")
    dtensor_keys = [key for key, value in state.items() if is_dtensor(value)]
    graph = Sequential([Gather(dtensor_keys), mapper]) if dtensor_keys else mapper
    order = {key: position for position, key in enumerate(state)}
    # state_dict order is the same on the ranks that share a tensor, so they gather it at the same point.
    groups = sorted(graph.groups(), key=lambda group: min(order[key] for key in group.inputs))
    writes = [min(r for r, keys in enumerate(held) if keys.issuperset(g.inputs)) == rank for g in groups]
    writer = ShardedWriter(
        directory,
        max_shard_bytes=max_shard_bytes,
        metadata=metadata,
        extra_files=extra_files,
        distributed=len(held) > 1,  # commits collectively: every rank returns once the checkpoint is in place
        single_file=single_file,
    )
    with torch.no_grad(), writer:
        for group, mine in zip(groups, writes, strict=True):
            outputs = graph.consume({key: state[key] for key in group.inputs})
            if mine:
                _write_all(writer, outputs)
            del outputs
    return Path(directory).absolute()


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    mapper: ModelStateMapper,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
) -> Path:
    """Disk → disk through ``mapper``; peak memory is about one group plus one shard.

    ``destination`` may equal ``source``: everything is read before the new directory replaces the old one.
    ``extra_files`` (name → content, e.g. ``config.json``) are committed with the weights.
    """
    reader = CheckpointReader(source)
    with ShardedWriter(
        destination, max_shard_bytes=max_shard_bytes, metadata=metadata, extra_files=extra_files
    ) as writer:
        for result in reader.stream(mapper, target_name=str(destination)):
            _write_all(writer, result.outputs)
            del result  # free this group before the next one is read
    return writer.directory
