"""A LoRA run's training checkpoint as Hugging Face files, without the run's code (``dcp-to-hf --base``).

Such a checkpoint holds the adapters, the frozen base's fingerprint and the LoRA settings (``state/frozen.py``),
not the base. :class:`JoinedReader` reads the base's Hugging Face folder and the checkpoint's model section as one
source, the base's keys under :data:`BASE_NAMESPACE`, and :func:`merged_mapper` is the graph from that source to a
Hugging Face model: the base through its format's reading mapping into module keys, cast to the dtypes the run kept
the frozen parameters in, checked tensor by tensor against the fingerprint (:class:`CheckBase`: a base the adapters
were not trained on is refused naming the parameter), the adapters merged in (``peft.MergeLoRA``, as ``ExportHF``
merges them), and the format's writing mapping. One group in memory at a time, as every conversion.

What the command line asks of such a checkpoint is here too: whether it is one (:func:`read_lora_meta`), what it
records (:func:`recorded_lora`, :func:`recorded_base`), the merge planned (:func:`base_merge`) and the ``peft``
adapter directory planned (:func:`adapter_export`, ``--lora adapter``). ``convert.py`` keeps the options and the
writing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..compose import Parallel, Scope, Sequential
from ..dcp import DCPReader
from ..errors import CheckpointError, format_keys
from ..frozen import FINGERPRINT_KEY, LoRARecord, is_fingerprint, read_lora_record, same_sums, tensor_sums
from ..graph import infer_shapes
from ..mapper import Cast, Drop, Group, ModelStateMapper, Rename
from ..reader import CheckpointReader
from ..stream import MappedReader, ReadKeys, ReadPlan
from ..training import CALLBACKS_SECTION, read_meta
from .io import reading_mapper, writing_mapper
from .peft import (
    ADAPTER_CONFIG,
    ADAPTER_PARTS,
    EXPERTS_ADAPTER,
    MergeLoRA,
    peft_mapper,
    recorded_adapters,
    recorded_peft_config,
)
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
        yield from (BASE_NAMESPACE + key for key in self.base.keys_in_order())
        yield from self.checkpoint.keys_in_order()

    def _source_name(self) -> str:
        return f"the base {self.base.name} with {self.checkpoint.source_name()}"

    def _order(self, mapper: ModelStateMapper) -> ReadPlan:
        info = self.base.tensor_info()  # checks every shard's header on the way
        files = list(dict.fromkeys(self.base.weight_map.values()))
        file_rank = {name: position for position, name in enumerate(files)}
        trained = {key: position for position, key in enumerate(self.checkpoint.keys_in_order())}
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
            return self.base.file_of(key[len(BASE_NAMESPACE) :])
        return self.checkpoint.file_of(key)

    @contextmanager
    def _reading(self, plan: ReadPlan) -> Iterator[ReadKeys]:
        cut = len(BASE_NAMESPACE)
        from_base = [
            key[cut:] for group in plan.groups for key in group.inputs if key.startswith(BASE_NAMESPACE)
        ]
        with self.base.open_for(from_base) as read_base:

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


def _strip_prefix(entries: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``entries`` under ``prefix`` (a LightningModule's ``model.``), by their names without it."""
    return {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}


# ------------------------------------------------------------------------------ what the command line asks
def read_lora_meta(checkpoint: Path) -> dict[str, Any] | None:
    """``meta.pt``'s content when ``checkpoint`` is a LoRA run's (it records a fingerprint of the frozen base in place
    of the base), else ``None``."""
    try:
        meta = read_meta(checkpoint, weights_only=True, map_location="cpu")
    except CheckpointError:  # missing, or unreadable: the conversion's own checks say why
        return None
    return meta if FINGERPRINT_KEY in meta else None


def recorded_base(meta: Mapping[str, Any]) -> str | None:
    """The folder ``LoadHFWeights`` loaded the model from, as recorded in the checkpoint's callback states."""
    for name, state in (meta.get(CALLBACKS_SECTION) or {}).items():
        if (
            str(name).startswith("LoadHFWeights")
            and isinstance(state, dict)
            and isinstance(state.get("source"), str)
        ):
            return str(state["source"])
    return None


def recorded_lora(meta: Mapping[str, Any], checkpoint: str) -> tuple[Fingerprint, LoRARecord]:
    """The frozen base's fingerprint and the LoRA settings that a LoRA run's ``meta.pt`` (``meta``, untrusted)
    records, checked: a damaged fingerprint, or a checkpoint of a version that recorded no settings, is refused."""
    fingerprint = meta[FINGERPRINT_KEY]
    if not is_fingerprint(fingerprint):
        raise CheckpointError(
            f"{checkpoint}: meta.pt's {FINGERPRINT_KEY!r} is not a fingerprint of frozen parameters (name -> (sum, "
            "sum of squares, numel)): the file is damaged or crafted; choose another checkpoint"
        )
    record = read_lora_record(meta, checkpoint)
    if record is None:
        raise CheckpointError(
            f"{checkpoint} is a LoRA run's checkpoint that records no LoRA settings (rank, alpha, layouts), which "
            "the merge needs: it was saved by an earlier version of lightning_d9d. Export it from a run that "
            "resumes it with ExportHF(dirpath, lora='merged' | 'adapter' | 'both') among its callbacks"
        )
    return fingerprint, record


def under_prefix(prefix: str, fingerprint: Fingerprint, record: LoRARecord) -> tuple[Fingerprint, LoRARecord]:
    """The fingerprint and the record's per-parameter entries under ``prefix``, by their module names."""
    return _strip_prefix(fingerprint, prefix), dataclasses.replace(
        record,
        frozen_dtypes=_strip_prefix(record.frozen_dtypes, prefix),
        expert_layouts=_strip_prefix(record.expert_layouts, prefix),
    )


@dataclasses.dataclass(frozen=True)
class BaseMerge:
    """A LoRA checkpoint merged into its base, planned: ``reader`` read through ``mapper`` gives the Hugging Face
    weights, in ``dtype``. ``trained``: the checkpoint's module keys but the tied aliases; ``aliases``: the tied
    aliases it holds, read once under their other name."""

    reader: JoinedReader
    mapper: ModelStateMapper
    trained: frozenset[str]
    aliases: frozenset[str]
    dtype: torch.dtype | None


def base_merge(
    base: CheckpointReader,
    checkpoint: DCPReader,
    fmt: HFFormat,
    config: HFConfig,
    *,
    fingerprint: Fingerprint,
    record: LoRARecord,
    dtype: torch.dtype | None,
    layout: str | None,
    where: str,
    fix: str,
) -> BaseMerge:
    """The merge of ``checkpoint``'s adapters (its reader at the model's prefix; ``fingerprint`` and ``record`` by
    module key) into the ``base`` folder's weights, planned and checked as far as no tensor is read
    (:func:`merged_mapper`). The weights come out in ``dtype``, else in the dtype the run kept the base in."""
    aliases = set(fmt.tied(config))
    trained = checkpoint.keys() - aliases
    mapper = merged_mapper(
        fmt,
        config,
        base_keys=base.keys(),
        base_shapes={key: value.shape for key, value in base.tensor_info().items()},
        trained=trained,
        frozen=fingerprint,
        record=record,
        dtype=dtype,
        layout=layout,
        where=where,
        fix=fix,
    )
    kept = next(iter(record.frozen_dtypes.values()), None)  # the frozen base's dtype: the merged weights'
    return BaseMerge(
        JoinedReader(base, checkpoint),
        mapper,
        frozenset(trained),
        frozenset(aliases & checkpoint.keys()),
        dtype if dtype is not None else kept,
    )


@dataclasses.dataclass(frozen=True)
class AdapterExport:
    """A checkpoint's adapters as a ``peft`` adapter directory, planned: ``mapper`` from the checkpoint's adapter
    keys to peft's, ``ignore`` the trained state beyond the adapters (not peft's), ``files`` the
    ``adapter_config.json`` beside the weights."""

    mapper: ModelStateMapper
    ignore: frozenset[str]
    files: dict[str, str]


def adapter_export(
    checkpoint: DCPReader,
    record: LoRARecord,
    *,
    base_name: str | None,
    dtype: torch.dtype | None,
    source: str,
) -> AdapterExport:
    """The adapters ``checkpoint`` holds (its reader at the model's prefix, ``record`` by module key) as peft writes
    them; no base is read, ``base_name`` is recorded as ``base_model_name_or_path``; ``source`` names the
    checkpoint in errors."""
    settings = recorded_adapters(
        checkpoint.keys(),
        rank=record.rank,
        alpha=record.alpha,
        dropout=record.dropout,
        expert_layouts=record.expert_layouts,
    )
    config = recorded_peft_config(settings, base_name, source=source)
    mapper = peft_mapper(settings, dtype)
    return AdapterExport(
        mapper,
        frozenset(checkpoint.keys() - mapper.input_keys()),
        {ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"},
    )
