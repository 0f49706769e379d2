"""Checks on a whole mapper graph, made before any tensor is read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from .errors import KeyCoverageError, format_keys
from .mapper import ModelStateMapper


def check_coverage(
    mapper: ModelStateMapper,
    *,
    source_keys: Iterable[str] | None = None,
    target_keys: Iterable[str] | None = None,
    source_name: str = "the source",
    target_name: str = "the target",
) -> None:
    """Raise ``KeyCoverageError`` unless ``mapper`` reads exactly ``source_keys`` and writes exactly
    ``target_keys`` (either side may be ``None``: not checked).

    The message names the keys (the first few of each kind, and a count), which is what tells "another model's
    checkpoint" from "a forgotten rename".
    """
    reads, writes = mapper.input_keys(), mapper.output_keys()
    missing_source = unexpected_source = missing_target = unexpected_target = frozenset[str]()
    if source_keys is not None:
        source = frozenset(source_keys)
        missing_source, unexpected_source = reads - source, source - reads
    if target_keys is not None:
        target = frozenset(target_keys)
        missing_target, unexpected_target = target - writes, writes - target
    problems = [
        (missing_source, f"read by the mapper but missing from {source_name}"),
        (unexpected_source, f"in {source_name} but not read by the mapper (drop them explicitly with Drop)"),
        (missing_target, f"expected by {target_name} but not produced by the mapper"),
        (unexpected_target, f"produced by the mapper but not expected by {target_name}"),
    ]
    lines = [
        f"  {len(keys)} {'key' if len(keys) == 1 else 'keys'} {what}: {format_keys(keys)}"
        for keys, what in problems
        if keys
    ]
    if lines:
        raise KeyCoverageError(
            f"the mapper does not match {source_name} -> {target_name}:\n" + "\n".join(lines),
            missing_source=missing_source,
            unexpected_source=unexpected_source,
            missing_target=missing_target,
            unexpected_target=unexpected_target,
        )


def infer_shapes(
    mapper: ModelStateMapper, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype = torch.float32
) -> dict[str, tuple[int, ...]]:
    """The shapes ``mapper`` writes, given the shapes of what it reads, computed on meta tensors (no memory, no
    data): how a checkpoint in one layout can be checked against a config that describes another."""
    inferred: dict[str, tuple[int, ...]] = {}
    for group in mapper.groups():
        inputs = {key: torch.empty(tuple(shapes[key]), dtype=dtype, device="meta") for key in group.inputs}
        for key, value in mapper.consume(inputs).items():
            inferred[key] = tuple(value.shape)
    return inferred
