"""The plan-and-stream loop that every checkpoint reader shares.

A reader (safetensors in ``reader.py``, DCP in ``dcp.py``) says which keys it holds, in which order to read a
mapper's groups, where each key lives and how to read a list of keys. ``MappedReader`` does the rest, once for
all of them: the key check against the mapper graph, and the loop that reads a group, maps it, checks that the
mapper returned exactly the keys the group declares, yields it and lets it go before the next group is read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .errors import MapperError, format_keys
from .graph import check_coverage
from .mapper import Group, ModelStateMapper

# Reads the tensors of a list of keys (one group's inputs), each into memory of its own.
ReadKeys = Callable[[list[str]], dict[str, Tensor]]


@dataclass(frozen=True)
class GroupResult:
    """The outputs of one group, with the files its inputs came from (for error messages)."""

    group: Group
    outputs: dict[str, Tensor]
    files: dict[str, str] = field(default_factory=dict)  # input key -> shard file name

    def origin(self) -> str:
        """``'a', 'b' in model-00001-of-00002.safetensors``: where this group's inputs were read."""
        by_file: dict[str, list[str]] = {}
        for key, name in self.files.items():
            by_file.setdefault(name, []).append(key)
        return "; ".join(f"{format_keys(keys, limit=3)} in {name}" for name, keys in by_file.items())


@dataclass(frozen=True)
class ReadPlan:
    """Groups in reading order, with the bytes each one reads, and the files that will be opened."""

    groups: list[Group]
    input_bytes: list[int]
    files: list[str]

    @classmethod
    def in_order(
        cls,
        mapper: ModelStateMapper,
        *,
        position: Callable[[str], Any],
        nbytes: Callable[[str], int],
        files: Iterable[str],
    ) -> ReadPlan:
        """The mapper's groups sorted by where their first input lies, so storage is swept front to back."""
        groups = sorted(mapper.groups(), key=lambda group: min(map(position, group.inputs)))
        return cls(groups=groups, input_bytes=[sum(map(nbytes, g.inputs)) for g in groups], files=list(files))

    @property
    def largest_group_bytes(self) -> int:
        return max(self.input_bytes, default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.input_bytes)


class MappedReader(ABC):
    """A checkpoint read through mappers: ``reader.stream(mapper)`` yields one ``GroupResult`` per group."""

    name: str  # the file that describes the checkpoint (its index or metadata), for messages

    # ------------------------------------------------------------------------- what each format provides
    @abstractmethod
    def _stored_keys(self) -> Iterable[str]:
        """Every key this reader offers, in storage order."""

    def _source_name(self) -> str:
        return f"checkpoint {self.name}"

    @abstractmethod
    def _order(self, mapper: ModelStateMapper) -> ReadPlan:
        """The groups in reading order, once every file they need has been checked (sizes, headers)."""

    @abstractmethod
    def _file_of(self, key: str) -> str:
        """The file ``key`` is read from, as error messages name it."""

    @abstractmethod
    def _reading(self, plan: ReadPlan) -> AbstractContextManager[ReadKeys]:
        """Open what ``plan`` reads; the context gives the function that reads a group's inputs."""

    # ---------------------------------------------------------------------------------- shared behaviour
    def plan(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
        ignore: Iterable[str] = (),
    ) -> ReadPlan:
        """Check everything that can be checked without reading a tensor; return the reading order.

        ``ignore``: keys of the checkpoint deliberately not read (another pipeline stage's layers, tied aliases).
        """
        skipped = set(ignore)
        check_coverage(
            mapper,
            source_keys=[key for key in self._stored_keys() if key not in skipped],
            target_keys=target_keys,
            source_name=self._source_name(),
            target_name=target_name,
        )
        return self._order(mapper)

    def stream(
        self,
        mapper: ModelStateMapper,
        *,
        target_keys: Iterable[str] | None = None,
        target_name: str = "the target",
        ignore: Iterable[str] = (),
    ) -> Iterator[GroupResult]:
        """Yield each group's outputs as soon as its inputs are read; inputs are freed before the next group.

        Keep references to a result only as long as needed: whatever the consumer holds stays in memory.
        """
        plan = self.plan(mapper, target_keys=target_keys, target_name=target_name, ignore=ignore)
        with self._reading(plan) as read:
            for group in plan.groups:
                files = {key: self._file_of(key) for key in group.inputs}
                inputs = read(list(group.inputs))
                try:
                    outputs = mapper.consume(inputs)  # empties ``inputs``: the mapper owns them now
                except MapperError as error:
                    origin = GroupResult(group, {}, files).origin()
                    raise MapperError(f"{error} (while mapping {origin})") from error
                if outputs.keys() != set(group.outputs):
                    raise MapperError(
                        f"{mapper!r} returned {format_keys(outputs)} for a group that declares "
                        f"{format_keys(group.outputs)} (while mapping {GroupResult(group, {}, files).origin()})"
                    )
                result = GroupResult(group, outputs, files)
                del outputs
                yield result
                del result
