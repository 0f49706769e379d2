"""Composing mappers: side by side (``Parallel``), one after another (``Sequential``), under a key prefix
(``Scope``, ``per_layer``).

Every composite is itself a ``ModelStateMapper`` whose groups are computed once, so a reader sees one flat graph
from the disk layout to the module layout, however deep the composition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

from .errors import MapperError, format_keys
from .mapper import Drop, Group, Identity, ModelStateMapper, Rename


class Parallel(ModelStateMapper):
    """Mappers over disjoint key sets, side by side."""

    def __init__(self, mappers: Iterable[ModelStateMapper]) -> None:
        self.mappers = tuple(mappers)
        self._owner: dict[str, int] = {}
        written: dict[str, int] = {}
        for position, mapper in enumerate(self.mappers):
            for side, keys, seen in (
                ("read", mapper.input_keys(), self._owner),
                ("written", mapper.output_keys(), written),
            ):
                clash = [key for key in keys if key in seen]
                if clash:
                    other = self.mappers[seen[clash[0]]]
                    raise MapperError(
                        f"Parallel: {format_keys(clash)} {side} by both {other!r} and {mapper!r}; "
                        "parallel mappers must touch disjoint keys"
                    )
                seen.update(dict.fromkeys(keys, position))

    def groups(self) -> list[Group]:
        return [group for mapper in self.mappers for group in mapper.groups()]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.consume(dict(inputs))

    def consume(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        self.group_index(inputs)  # validates that ``inputs`` is exactly one group
        return self.mappers[self._owner[next(iter(inputs))]].consume(inputs)

    def inverse(self) -> Parallel:
        return Parallel(mapper.inverse() for mapper in self.mappers)

    def __repr__(self) -> str:
        return f"Parallel({len(self.mappers)} mappers)"


class Scope(ModelStateMapper):
    """``mapper`` applied under ``prefix``: its keys ``k`` are ``prefix + k`` from the outside."""

    def __init__(self, prefix: str, mapper: ModelStateMapper) -> None:
        self.prefix, self.mapper = prefix, mapper

    def groups(self) -> list[Group]:
        add = self.prefix.__add__
        return [Group(tuple(map(add, g.inputs)), tuple(map(add, g.outputs))) for g in self.mapper.groups()]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.consume(dict(inputs))

    def consume(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        self.group_index(inputs)
        cut = len(self.prefix)
        inner = {key[cut:]: tensor for key, tensor in inputs.items()}
        inputs.clear()
        outputs = self.mapper.consume(inner)
        return {self.prefix + key: tensor for key, tensor in outputs.items()}

    def inverse(self) -> Scope:
        return Scope(self.prefix, self.mapper.inverse())

    def __repr__(self) -> str:
        return f"Scope({self.prefix!r}, {self.mapper!r})"


def per_layer(
    template: str, indices: Iterable[int], mapper: ModelStateMapper | Callable[[int], ModelStateMapper]
) -> Parallel:
    """The same mapper under each of ``template.format(i=i)``, e.g. ``per_layer("model.layers.{i}.", range(n), m)``.

    ``mapper`` may be a function of the layer index when layers differ (dense and MoE layers mixed).
    """
    if "{i}" not in template:
        raise MapperError(f"per_layer template {template!r} must contain '{{i}}'")
    build = (lambda _: mapper) if isinstance(mapper, ModelStateMapper) else mapper
    return Parallel(Scope(template.format(i=i), build(i)) for i in indices)


class Subset(ModelStateMapper):
    """The groups of ``mapper`` that lie within ``keys`` on one ``side``: ``"outputs"`` to load a part of a model
    (one pipeline stage holds some layers), ``"inputs"`` to save one. A group partly inside is an error: a part of
    a model cannot split a group (fused q·k·v, stacked experts) between two owners. With ``side="outputs"``,
    groups that write nothing (``Drop``) are left out too: no part needs them read.
    """

    def __init__(self, mapper: ModelStateMapper, keys: Iterable[str], *, side: str = "outputs") -> None:
        if side not in ("inputs", "outputs"):
            raise MapperError(f"Subset: side must be 'inputs' or 'outputs', not {side!r}")
        self.mapper, self.side, self._keys = mapper, side, frozenset(keys)
        kept: list[Group] = []
        for group in mapper.groups():
            names = group.outputs if side == "outputs" else group.inputs
            inside = [name in self._keys for name in names]
            if names and all(inside):
                kept.append(group)
            elif any(inside):
                raise MapperError(
                    f"Subset: a group of {mapper!r} is split: {format_keys(names)} are its {side}, of which only "
                    f"{format_keys(n for n, i in zip(names, inside, strict=True) if i)} are here"
                )
        self._groups = kept

    def groups(self) -> list[Group]:
        return list(self._groups)

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.consume(dict(inputs))

    def consume(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        self.group_index(inputs)  # one of the kept groups, exactly
        return self.mapper.consume(inputs)

    def inverse(self) -> Subset:
        return Subset(
            self.mapper.inverse(), self._keys, side="inputs" if self.side == "outputs" else "outputs"
        )

    def __repr__(self) -> str:
        return f"Subset({self.mapper!r}, {len(self._keys)} {self.side})"


def select_prefix(keys: Iterable[str], prefix: str, *, strip: bool = False) -> ModelStateMapper:
    """Keep the keys under ``prefix`` (without it if ``strip``) and drop the rest of ``keys``."""
    keys = list(keys)
    kept = [key for key in keys if key.startswith(prefix)]
    dropped = [key for key in keys if not key.startswith(prefix)]
    keep: ModelStateMapper = Rename.prefix(kept, prefix, "") if strip else Identity(kept)
    return Parallel([keep, Drop(dropped)]) if dropped else keep  # without a Drop it stays invertible


# ------------------------------------------------------------------------------------------- sequential
@dataclass(frozen=True)
class _Component:
    """A group of a ``Sequential``: the stage groups it runs, stage by stage, from its source keys."""

    group: Group
    stages: tuple[tuple[tuple[ModelStateMapper, Group], ...], ...]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, node: int) -> int:
        while self.parent[node] != node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


class Sequential(ModelStateMapper):
    """Mappers one after another: the keys written by one are read by the next.

    A key that a stage does not read passes through it unchanged, and a key first read by a later stage comes
    straight from the input; so ``Sequential([Rename(...), Stack(...)])`` needs no identity fillers. A stage
    may not write a key that also passes through it, nor read a key an earlier stage already consumed.

    The net groups are the connected pieces of the stage graph: whatever a stack in stage 2 needs from renames
    in stage 1 becomes one group, applied at once.
    """

    def __init__(self, mappers: Iterable[ModelStateMapper]) -> None:
        self.mappers = tuple(mappers)
        if not self.mappers:
            raise MapperError("Sequential needs at least one mapper")
        self._components = self._build()

    def _build(self) -> list[_Component]:
        nodes = _UnionFind()
        live: dict[str, int] = {}  # key -> node of its current tensor
        sources: dict[str, int] = {}  # source key -> node, in order of first use
        consumed: dict[str, int] = {}  # key -> stage that consumed it and did not write it back
        steps: list[tuple[int, ModelStateMapper, Group, int]] = []
        for stage, mapper in enumerate(self.mappers):
            read: set[str] = set()
            written: dict[str, int] = {}
            for group in mapper.groups():
                step = nodes.new()
                for key in group.inputs:
                    if key not in live:
                        if key in consumed or key in sources:
                            raise MapperError(
                                f"Sequential: stage {stage} ({mapper!r}) reads {key!r}, which stage "
                                f"{consumed.get(key, 0)} already consumed"
                            )
                        sources[key] = live[key] = nodes.new()
                    read.add(key)
                    nodes.union(step, live[key])
                for key in group.outputs:
                    written[key] = nodes.new()
                    nodes.union(step, written[key])
                steps.append((stage, mapper, group, step))
            passed = {key: node for key, node in live.items() if key not in read}
            clash = passed.keys() & written.keys()
            if clash:
                raise MapperError(
                    f"Sequential: stage {stage} ({mapper!r}) writes {format_keys(clash)}, which the previous "
                    "stage also produced and this stage does not read"
                )
            for key in read - written.keys():
                consumed[key] = stage
            for key in written:
                consumed.pop(key, None)
            live = {**passed, **written}

        # One component per connected piece, ordered by its first source key.
        roots: dict[int, list[str]] = {}
        for key, node in sources.items():
            roots.setdefault(nodes.find(node), []).append(key)
        outputs: dict[int, list[str]] = {}
        for key, node in live.items():
            outputs.setdefault(nodes.find(node), []).append(key)
        by_root: dict[int, list[list[tuple[ModelStateMapper, Group]]]] = {
            root: [[] for _ in self.mappers] for root in roots
        }
        for stage, mapper, group, step in steps:
            by_root[nodes.find(step)][stage].append((mapper, group))
        return [
            _Component(
                Group(tuple(keys), tuple(outputs.get(root, ()))),
                tuple(tuple(stage) for stage in by_root[root] if stage),
            )
            for root, keys in roots.items()
        ]

    def groups(self) -> list[Group]:
        return [component.group for component in self._components]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.consume(dict(inputs))

    def consume(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        component = self._components[self.group_index(inputs)]
        live = dict(inputs)
        inputs.clear()
        for stage in component.stages:
            # Take every input of the stage before writing any output: one group's output may reuse the name
            # of another group's input within the same stage.
            taken = [(mapper, {key: live.pop(key) for key in group.inputs}) for mapper, group in stage]
            for mapper, stage_inputs in taken:
                # consume() empties stage_inputs, so each intermediate is freed as soon as its stage is done.
                live.update(mapper.consume(stage_inputs))
            del taken
        return live

    def inverse(self) -> Sequential:
        return Sequential(mapper.inverse() for mapper in reversed(self.mappers))

    def __repr__(self) -> str:
        return f"Sequential({', '.join(map(repr, self.mappers))})"


def chain(*mappers: ModelStateMapper) -> ModelStateMapper:
    """``Sequential`` of ``mappers``, or the mapper itself when there is one."""
    return mappers[0] if len(mappers) == 1 else Sequential(mappers)
