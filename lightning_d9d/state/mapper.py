"""The mapper abstraction and the leaf mappers.

A mapper is a declarative graph plus the code that runs it. ``groups()`` says which keys are read together and
which keys they become; ``apply`` turns one group's input tensors into its output tensors. Because the graph is
known before any tensor exists, a reader can check a checkpoint against it and plan its IO up front.

A mapper always points the way the data flows: disk → module to load, module → disk to save. ``inverse()``
gives the other direction where the transformation loses nothing (rename, transpose, stack, concat).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .errors import MapperError, NotInvertibleError, format_keys


@dataclass(frozen=True)
class Group:
    """The unit applied at once: all of ``inputs`` must be in memory, and ``outputs`` come out together."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        # Accept lists for convenience; keep tuples so groups stay hashable.
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.inputs:
            # Routing a tensor to its group goes through its input key; a group without inputs has no address.
            raise MapperError(f"a group must read at least one key (outputs {format_keys(self.outputs)})")
        for side, keys in (("inputs", self.inputs), ("outputs", self.outputs)):
            if len(set(keys)) != len(keys):
                raise MapperError(f"group lists a key twice in its {side}: {list(keys)}")


class _GroupIndex:
    """Which group each key belongs to, built once per mapper; also where duplicate keys are caught."""

    def __init__(self, owner: ModelStateMapper, groups: Sequence[Group]) -> None:
        self.groups = tuple(groups)
        self.by_input: dict[str, int] = {}
        by_output: dict[str, int] = {}
        for position, group in enumerate(self.groups):
            for key in group.inputs:
                if key in self.by_input:
                    raise MapperError(f"{owner!r} reads key {key!r} in two groups")
                self.by_input[key] = position
            for key in group.outputs:
                if key in by_output:
                    raise MapperError(f"{owner!r} writes key {key!r} in two groups")
                by_output[key] = position
        self.inputs = frozenset(self.by_input)
        self.outputs = frozenset(by_output)


class ModelStateMapper(ABC):
    """A checkpoint transformation: a fixed set of groups, each mapping some named tensors to others.

    Subclasses implement ``groups`` (pure, the same answer every call) and ``apply``; ``inverse`` where the
    transformation can be undone. Mappers are immutable once built.
    """

    @abstractmethod
    def groups(self) -> Sequence[Group]:
        """The groups of this mapper, in a stable order. Input keys are disjoint, output keys too."""

    @abstractmethod
    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Apply the one group whose inputs are exactly ``inputs``; return its outputs by key."""

    def consume(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``apply`` that takes ownership of ``inputs`` and empties it.

        The streaming reader hands each group over with this, so that no reference outside the mapper keeps an
        input alive: a composite frees every intermediate as soon as its stage is done, instead of holding all
        of them until the whole group returns.
        """
        outputs = self.apply(inputs)
        inputs.clear()
        return outputs

    def inverse(self) -> ModelStateMapper:
        """The mapper that undoes this one (outputs → inputs)."""
        raise NotInvertibleError(f"{self!r} has no inverse")

    # Shared plumbing: subclasses normally do not override these.
    @cached_property
    def _index(self) -> _GroupIndex:
        return _GroupIndex(self, self.groups())

    def input_keys(self) -> frozenset[str]:
        return self._index.inputs

    def output_keys(self) -> frozenset[str]:
        return self._index.outputs

    def group_index(self, inputs: Iterable[str]) -> int:
        """Position (in ``groups()``) of the group whose inputs are exactly ``inputs``."""
        keys = set(inputs)
        if not keys:
            raise MapperError(f"{self!r}.apply got no tensors")
        first = min(keys)
        position = self._index.by_input.get(first)
        if position is None:
            raise MapperError(f"{self!r} does not read key {first!r}")
        expected = set(self._index.groups[position].inputs)
        if keys != expected:
            raise MapperError(
                f"{self!r}: a group must be applied with exactly its inputs; "
                f"missing {format_keys(expected - keys)}; extra {format_keys(keys - expected)}"
            )
        return position

    def group_for(self, inputs: Iterable[str]) -> Group:
        return self._index.groups[self.group_index(inputs)]


# --------------------------------------------------------------------------------------------- key-wise
class _KeyWise(ModelStateMapper):
    """One group per key, ``key -> new key`` (or ``key -> nothing``), each tensor transformed on its own."""

    def __init__(self, mapping: Mapping[str, str | None]) -> None:
        self._mapping = dict(mapping)

    def groups(self) -> list[Group]:
        return [Group((src,), () if dst is None else (dst,)) for src, dst in self._mapping.items()]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        group = self.group_for(inputs)
        (key,) = group.inputs
        if not group.outputs:
            return {}
        return {group.outputs[0]: self._transform(key, inputs[key])}

    def _transform(self, key: str, tensor: Tensor) -> Tensor:
        return tensor

    def _keys_repr(self) -> str:
        return format_keys(self._mapping, limit=3)


class Identity(_KeyWise):
    """Pass ``keys`` through unchanged."""

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__({key: key for key in keys})

    def inverse(self) -> Identity:
        return self

    def __repr__(self) -> str:
        return f"Identity({self._keys_repr()})"


class Rename(_KeyWise):
    """Rename keys: ``{old: new}``. ``Rename.prefix`` builds one from a prefix substitution."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        super().__init__(mapping)

    @classmethod
    def prefix(cls, keys: Iterable[str], old: str, new: str) -> Rename:
        """Rename the keys that start with ``old`` to start with ``new``; other keys are not part of it.

        Leaving the others out (rather than passing them through) lets it sit in a ``Sequential``, which passes
        untouched keys along by itself.
        """
        return cls({key: new + key[len(old) :] for key in keys if key.startswith(old)})

    def inverse(self) -> Rename:
        return Rename({dst: src for src, dst in self._mapping.items() if dst is not None})

    def __repr__(self) -> str:
        pairs = list(self._mapping.items())
        shown = ", ".join(f"{src!r}: {dst!r}" for src, dst in pairs[:2])
        more = f", ... {len(pairs) - 2} more" if len(pairs) > 2 else ""
        return f"Rename({{{shown}{more}}})"


class Drop(_KeyWise):
    """Read ``keys`` and discard them (e.g. ``rotary_emb.inv_freq`` left in old checkpoints)."""

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__(dict.fromkeys(keys))

    def __repr__(self) -> str:
        return f"Drop({self._keys_repr()})"


class Transpose(_KeyWise):
    """Swap two dims of each of ``keys``; the output is contiguous so it can be written as is."""

    def __init__(self, keys: Iterable[str], dim0: int = 0, dim1: int = 1) -> None:
        super().__init__({key: key for key in keys})
        self.dim0, self.dim1 = dim0, dim1

    def _transform(self, key: str, tensor: Tensor) -> Tensor:
        return tensor.transpose(self.dim0, self.dim1).contiguous()

    def inverse(self) -> Transpose:
        return self

    def __repr__(self) -> str:
        return f"Transpose({self._keys_repr()}, dim0={self.dim0}, dim1={self.dim1})"


class Cast(_KeyWise):
    """Convert ``keys`` to ``dtype``. Invertible only if ``source_dtype`` says what to convert back to.

    ``floating_only`` leaves integer and boolean tensors as they are (casting a whole checkpoint to bf16 must not
    turn an index buffer into floats). A down-cast followed by its inverse is of course not bit-exact; the inverse
    only restores the dtype.
    """

    def __init__(
        self,
        keys: Iterable[str],
        dtype: torch.dtype,
        source_dtype: torch.dtype | None = None,
        *,
        floating_only: bool = False,
    ) -> None:
        super().__init__({key: key for key in keys})
        self.dtype, self.source_dtype, self.floating_only = dtype, source_dtype, floating_only

    def _transform(self, key: str, tensor: Tensor) -> Tensor:
        if self.floating_only and not tensor.is_floating_point():
            return tensor
        return tensor.to(self.dtype)

    def inverse(self) -> Cast:
        if self.source_dtype is None:
            raise NotInvertibleError(f"{self!r} has no inverse: give source_dtype to cast back")
        return Cast(self._mapping, self.source_dtype, self.dtype, floating_only=self.floating_only)

    def __repr__(self) -> str:
        return f"Cast({self._keys_repr()}, {self.dtype})"


# ------------------------------------------------------------------------------------------ many-to-one
class _SingleGroup(ModelStateMapper):
    """A mapper made of exactly one group (stack, concat and their inverses)."""

    def __init__(self, inputs: Sequence[str], outputs: Sequence[str], dim: int) -> None:
        self._group = Group(tuple(inputs), tuple(outputs))
        self.dim = dim

    def groups(self) -> list[Group]:
        return [self._group]

    def _check(self, inputs: Mapping[str, Tensor]) -> None:
        self.group_index(inputs)  # raises unless the keys are exactly this group's

    def __repr__(self) -> str:
        group = self._group
        return (
            f"{type(self).__name__}({format_keys(group.inputs, limit=3)} -> "
            f"{format_keys(group.outputs, limit=3)}, dim={self.dim})"
        )


def _shapes(keys: Sequence[str], inputs: Mapping[str, Tensor]) -> str:
    return ", ".join(f"{key!r}: {tuple(inputs[key].shape)}" for key in keys)


class Stack(_SingleGroup):
    """Stack ``inputs`` (equal shapes) into ``output`` along a new dim, e.g. per-expert weights → ``[E, ...]``."""

    def __init__(self, inputs: Sequence[str], output: str, dim: int = 0) -> None:
        super().__init__(inputs, (output,), dim)

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self._check(inputs)
        keys = self._group.inputs
        if len({inputs[key].shape for key in keys}) != 1:
            raise MapperError(f"{self!r}: cannot stack tensors of different shapes ({_shapes(keys, inputs)})")
        return {self._group.outputs[0]: torch.stack([inputs[key] for key in keys], dim=self.dim)}

    def inverse(self) -> Unstack:
        return Unstack(self._group.outputs[0], self._group.inputs, self.dim)


class Unstack(_SingleGroup):
    """Split ``input`` along ``dim`` into ``len(outputs)`` tensors with that dim removed (inverse of Stack)."""

    def __init__(self, input: str, outputs: Sequence[str], dim: int = 0) -> None:
        super().__init__((input,), outputs, dim)

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self._check(inputs)
        (key,) = self._group.inputs
        tensor = inputs[key]
        count = len(self._group.outputs)
        if tensor.ndim == 0 or tensor.shape[self.dim] != count:
            raise MapperError(
                f"{self!r}: {key!r} has shape {tuple(tensor.shape)}, expected size {count} in dim {self.dim}"
            )
        # Views of the input; whoever keeps them (writer, module copy) makes its own compact copy.
        return dict(zip(self._group.outputs, tensor.unbind(self.dim), strict=True))

    def inverse(self) -> Stack:
        return Stack(self._group.outputs, self._group.inputs[0], self.dim)


class Concat(_SingleGroup):
    """Concatenate ``inputs`` along an existing ``dim`` into ``output`` (e.g. q, k, v → qkv).

    ``sizes`` (the size of each input along ``dim``) is checked when given, and needed by the inverse when the
    parts differ in size (grouped-query attention: k and v are smaller than q).
    """

    def __init__(
        self, inputs: Sequence[str], output: str, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        super().__init__(inputs, (output,), dim)
        if sizes is not None and len(sizes) != len(inputs):
            raise MapperError(f"Concat into {output!r}: {len(sizes)} sizes for {len(inputs)} inputs")
        self.sizes = None if sizes is None else tuple(sizes)

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self._check(inputs)
        keys = self._group.inputs
        if self.sizes is not None:
            found = tuple(inputs[key].shape[self.dim] for key in keys)
            if found != self.sizes:
                raise MapperError(
                    f"{self!r}: expected sizes {self.sizes} in dim {self.dim}, found {_shapes(keys, inputs)}"
                )
        try:
            fused = torch.cat([inputs[key] for key in keys], dim=self.dim)
        except RuntimeError as error:
            raise MapperError(f"{self!r}: cannot concatenate {_shapes(keys, inputs)}: {error}") from error
        return {self._group.outputs[0]: fused}

    def inverse(self) -> Chunk:
        return Chunk(self._group.outputs[0], self._group.inputs, self.dim, self.sizes)


class Chunk(_SingleGroup):
    """Split ``input`` along ``dim`` into ``outputs``: equal parts, or the given ``sizes`` (inverse of Concat)."""

    def __init__(
        self, input: str, outputs: Sequence[str], dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        super().__init__((input,), outputs, dim)
        if sizes is not None and len(sizes) != len(outputs):
            raise MapperError(f"Chunk of {input!r}: {len(sizes)} sizes for {len(outputs)} outputs")
        self.sizes = None if sizes is None else tuple(sizes)

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self._check(inputs)
        (key,) = self._group.inputs
        tensor = inputs[key]
        count = len(self._group.outputs)
        total = tensor.shape[self.dim] if tensor.ndim else 0
        sizes = self.sizes if self.sizes is not None else (total // count,) * count
        if sum(sizes) != total or (self.sizes is None and total % count):
            raise MapperError(
                f"{self!r}: {key!r} has size {total} in dim {self.dim}, which does not split into {list(sizes)}"
            )
        return dict(zip(self._group.outputs, tensor.split(list(sizes), dim=self.dim), strict=True))

    def inverse(self) -> Concat:
        return Concat(self._group.outputs, self._group.inputs[0], self.dim, self.sizes)
