"""A LoRA run's training checkpoint as Hugging Face files, without the run's code (``dcp-to-hf --base``).

Such a checkpoint holds the adapters, the frozen base's fingerprint and the LoRA settings (``state/frozen.py``),
not the base. :class:`JoinedReader` reads the base's Hugging Face folder and the checkpoint's model section as one
source, the base's keys under :data:`BASE_NAMESPACE`, and :func:`merged_mapper` is the graph from that source to a
Hugging Face model: the base through its format's reading mapping into module keys, cast to the dtypes the run kept
the frozen parameters in, checked tensor by tensor against the fingerprint (:class:`CheckBase`: a base the adapters
were not trained on is refused naming the parameter), the adapters merged in (``peft.MergeLoRA``, as ``ExportHF``
merges them), and the format's writing mapping. One group in memory at a time, as every conversion.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..compose import Parallel, Scope, Sequential
from ..dcp import DCPReader
from ..errors import CheckpointError, format_keys
from ..frozen import LoRARecord, same_sums, tensor_sums
from ..graph import infer_shapes
from ..mapper import Cast, Drop, Group, ModelStateMapper, Rename
from ..reader import CheckpointReader
from ..stream import MappedReader, ReadKeys, ReadPlan
from .io import reading_mapper, writing_mapper
from .peft import ADAPTER_PARTS, EXPERTS_ADAPTER, MergeLoRA
from .registry import HFConfig, HFFormat

# The base folder's keys in the joined source: apart from the checkpoint's, whatever names the two share
BASE_NAMESPACE = "base::"
Fingerprint = Mapping[str, tuple[float, float, int]]


class JoinedReader(MappedReader):
    """A base model's safetensors folder (its keys under :data:`BASE_NAMESPACE`) and a training checkpoint's model
    section (its keys relative to the checkpoint reader's prefix), read through one mapper: groups sweep the base's
    files front to back, each reading what it needs from both."""

    def __init__(self, base: CheckpointReader, checkpoint: DCPReader) -> None:
        self.base, self.checkpoint = base, checkpoint
        self.name = f"{base.name} and {checkpoint.name}"

    def _stored_keys(self) -> Iterable[str]:
        yield from (BASE_NAMESPACE + key for key in self.base._stored_keys())
        yield from self.checkpoint._stored_keys()

    def _source_name(self) -> str:
        return f"the base {self.base.name} with {self.checkpoint._source_name()}"

    def _order(self, mapper: ModelStateMapper) -> ReadPlan:
        info = self.base.tensor_info()  # checks every shard's header on the way
        files = list(dict.fromkeys(self.base.weight_map.values()))
        file_rank = {name: position for position, name in enumerate(files)}
        trained = {key: position for position, key in enumerate(self.checkpoint._stored_keys())}
        shapes, dtypes = self.checkpoint.shapes(), self.checkpoint.dtypes()

        def position(key: str) -> tuple[int, int, int]:
            if key.startswith(BASE_NAMESPACE):
                name = key[len(BASE_NAMESPACE) :]
                return (0, file_rank[self.base.weight_map[name]], info[name].start)
            return (1, trained[key], 0)

        def nbytes(key: str) -> int:
            if key.startswith(BASE_NAMESPACE):
                return info[key[len(BASE_NAMESPACE) :]].nbytes
            return torch.Size(shapes[key]).numel() * dtypes[key].itemsize

        return ReadPlan.in_order(
            mapper, position=position, nbytes=nbytes, files=[*files, self.checkpoint.name]
        )

    def _file_of(self, key: str) -> str:
        if key.startswith(BASE_NAMESPACE):
            return self.base._file_of(key[len(BASE_NAMESPACE) :])
        return self.checkpoint._file_of(key)

    @contextmanager
    def _reading(self, plan: ReadPlan) -> Iterator[ReadKeys]:
        cut = len(BASE_NAMESPACE)
        from_base = [
            Group(tuple(key[cut:] for key in group.inputs if key.startswith(BASE_NAMESPACE)), ())
            for group in plan.groups
            if any(key.startswith(BASE_NAMESPACE) for key in group.inputs)
        ]
        with self.base._reading(ReadPlan(from_base, [], [])) as read_base:

            def read(keys: list[str]) -> dict[str, Tensor]:
                base = [key[cut:] for key in keys if key.startswith(BASE_NAMESPACE)]
                tensors = {BASE_NAMESPACE + key: value for key, value in read_base(base).items()}
                trained = [key for key in keys if not key.startswith(BASE_NAMESPACE)]
                if trained:
                    tensors.update(self.checkpoint.read(trained))
                return tensors

            yield read


class CheckBase(ModelStateMapper):
    """Each frozen parameter as it is, once its float64 sums match the checkpoint's fingerprint (``saved``):
    otherwise a ``CheckpointError`` naming it, the base ``where`` it was read from, and the ``fix``."""

    def __init__(self, saved: Fingerprint, where: str, fix: str) -> None:
        self.saved, self.where, self.fix = dict(saved), where, fix

    def groups(self) -> list[Group]:
        return [Group((key,), (key,)) for key in self.saved]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        ((key, tensor),) = inputs.items()
        self.group_for(inputs)
        found = tensor_sums(tensor)
        if not same_sums(found, self.saved[key]):
            raise CheckpointError(
                f"{self.where}: {key} is not the base the adapters were trained on (sum {found[0]:.6g} vs "
                f"{self.saved[key][0]:.6g}, sum of squares {found[1]:.6g} vs {self.saved[key][1]:.6g}): {self.fix}"
            )
        return {key: tensor}

    def __repr__(self) -> str:
        return f"CheckBase({len(self.saved)} frozen parameters)"


def merged_mapper(
    fmt: HFFormat,
    config: HFConfig,
    *,
    base_keys: Collection[str],
    base_shapes: Mapping[str, tuple[int, ...]],
    trained: Collection[str],
    frozen: Fingerprint,
    record: LoRARecord,
    dtype: torch.dtype | None,
    layout: str | None,
    where: str,
    fix: str,
) -> ModelStateMapper:
    """The graph from a :class:`JoinedReader`'s keys (``base_keys`` of the base folder, namespaced, and the
    checkpoint's ``trained`` module keys) to Hugging Face keys: the base's frozen parameters (``frozen``: their
    fingerprint, by module key) cast to the dtypes ``record`` gives them and checked, the adapters merged in, the
    format's writing mapping (``dtype``, ``layout``). Refused before any tensor is read, naming them: frozen
    parameters the base does not hold or holds in another size, and frozen parameters the checkpoint holds too."""
    read = reading_mapper(fmt, config, base_keys)
    shapes = infer_shapes(read, base_shapes)  # module keys: what the base holds, by size
    _check_base_holds(frozen, shapes, where, fix)
    both = sorted(set(frozen) & set(trained))
    if both:
        raise CheckpointError(
            f"the checkpoint holds frozen parameters as well as their fingerprint ({format_keys(both, limit=3)}): "
            "it is not a LoRA run's checkpoint as the d9d strategies write it"
        )
    unused = [BASE_NAMESPACE + key for key in shapes if key not in frozen]  # the checkpoint's values stand
    undated = sorted(set(frozen) - set(record.frozen_dtypes))
    if undated:
        raise CheckpointError(
            f"the checkpoint records no dtype for the frozen {format_keys(undated, limit=3)}: its LoRA settings "
            "are damaged; choose another checkpoint"
        )
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in frozen:
        by_dtype.setdefault(record.frozen_dtypes[key], []).append(key)
    stages: list[ModelStateMapper] = [
        Scope(BASE_NAMESPACE, read),
        Parallel(
            [Rename({BASE_NAMESPACE + key: key for key in frozen}), *([Drop(unused)] if unused else [])]
        ),
        Parallel([Cast(keys, kept, floating_only=True) for kept, keys in by_dtype.items()]),
        CheckBase(frozen, where, fix),
    ]
    merge = _merge(trained, record)
    if merge is not None:
        stages.append(merge)
    stages.append(writing_mapper(fmt, config, dtype, layout))
    return Sequential(stages)


def _check_base_holds(
    frozen: Fingerprint, shapes: Mapping[str, tuple[int, ...]], where: str, fix: str
) -> None:
    missing = sorted(key for key in frozen if key not in shapes)
    if missing:
        raise CheckpointError(
            f"{where} holds no {format_keys(missing, limit=3)}, which the adapters' base had: {fix}"
        )
    for key, (_, _, numel) in frozen.items():
        found = torch.Size(shapes[key]).numel()
        if found != numel:
            raise CheckpointError(
                f"{where}: {key} has {found} values (shape {tuple(shapes[key])}), the adapters' base had {numel}: "
                f"{fix}"
            )


def _merge(trained: Collection[str], record: LoRARecord) -> MergeLoRA | None:
    """What folds the checkpoint's adapters (their keys among ``trained``) into their weights."""
    stacked = {name: (record.scaling, out_first) for name, out_first in record.expert_layouts.items()}
    factors = set()
    for name in stacked:
        experts, _, weight = name.rpartition(".")
        factors |= {f"{experts}.{EXPERTS_ADAPTER}.{part}.{weight}" for part in ADAPTER_PARTS}
    missing = sorted(factors - set(trained))
    if missing:
        raise CheckpointError(
            f"the checkpoint records adapted experts whose adapters it does not hold ({format_keys(missing, limit=3)})"
        )
    suffix = ".lora_A.weight"
    layers = {
        key.removesuffix(suffix): record.scaling
        for key in trained
        if key.endswith(suffix) and key not in factors
    }
    if not layers and not stacked:
        return None
    return MergeLoRA(layers, stacked)


def strip_prefix(entries: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``entries`` under ``prefix`` (a LightningModule's ``model.``), by their names without it."""
    return {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}
