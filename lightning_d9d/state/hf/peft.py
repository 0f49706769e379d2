"""LoRA adapters out of a training run, in the two forms the Hugging Face tools load.

- **Merged**: each adapted layer's weight written as ``W + (alpha / r) B A`` (:class:`MergeLoRA`, composed before
  the model's own format by ``save_hf``): a plain model directory that ``transformers`` loads as it is.
- **A peft adapter directory** (:func:`save_peft_adapter`): ``adapter_config.json`` and
  ``adapter_model.safetensors`` under ``peft``'s names (``base_model.model.<layer>.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the ``transformers`` base model.

Both stream through the same writer as every export (any mesh; each tensor gathered when its group is written).
An adapted layer is a :class:`~lightning_d9d.modules.lora.LoRALinear`; its state-dict keys are the base layer's
plus ``lora_A.weight`` / ``lora_B.weight``.

Adapted stacked experts hold an :class:`~lightning_d9d.modules.lora.ExpertsLoRA` (``<experts>.lora.lora_A.<weight>
[E, r, in]``, ``...lora_B.<weight> [E, out, r]``). Merged, each expert's matrix becomes ``W_e + (alpha / r) B_e A_e``
in the layout the weight holds. For ``peft`` they are ``target_parameters`` (its ``lora.ParamWrapper``): per weight
``lora_A.weight [E * r, in]`` (expert ``e``'s rows ``e*r ... e*r + r - 1``) and ``lora_B.weight [out, r * E]``
(expert ``e``'s columns ``e, E + e, 2E + e, ...``), as ``ParamWrapper.get_delta_factors`` reads them back. peft
wraps a module once per targeted parameter, in the module's parameter order, the last outermost: the keys of all but
the last carry one ``base_layer.`` per wrapper around theirs (``mlp.experts.base_layer.lora_A.weight`` for
``gate_up_proj``, ``mlp.experts.lora_A.weight`` for ``down_proj``). peft's wrapper takes no dropout: adapters on
experts trained with dropout are refused (export the merged weights instead).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..compose import Parallel, chain
from ..errors import CheckpointError
from ..mapper import Cast, Group, ModelStateMapper, Rename
from ..module_io import module_tensors, save_from_module

if TYPE_CHECKING:
    from lightning_d9d.modules.lora import ExpertsLoRA, LoRALinear

# The attribute of an experts module that holds its adapter (modules/lora.py's EXPERTS_ADAPTER)
EXPERTS_ADAPTER = "lora"
# Where the adapter blocks live. Read from sys.modules, never imported here: a process that never imported it holds
# no adapted layer, and `python -m lightning_d9d.convert` must not import the blocks (they pull in Lightning)
_LORA_BLOCKS = "lightning_d9d.modules.lora"

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's names: the transformers model sits at base_model.model of a PeftModel
PEFT_PREFIX = "base_model.model."
ADAPTER_PARTS = ("lora_A", "lora_B")


def lora_layers(module: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers of ``module``, by name relative to it."""
    blocks = sys.modules.get(_LORA_BLOCKS)
    if blocks is None:
        return {}
    return {name: child for name, child in module.named_modules() if isinstance(child, blocks.LoRALinear)}


def expert_adapters(module: nn.Module) -> dict[str, ExpertsLoRA]:
    """The per-expert adapters of ``module``, by the name of the experts module holding them."""
    blocks = sys.modules.get(_LORA_BLOCKS)
    if blocks is None:
        return {}
    suffix = f".{EXPERTS_ADAPTER}"
    return {
        name.removesuffix(suffix): child
        for name, child in module.named_modules()
        if isinstance(child, blocks.ExpertsLoRA) and name.endswith(suffix)
    }


def _factor_key(experts: str, part: str, weight: str) -> str:
    """The state-dict key of one side (``lora_A`` / ``lora_B``) of ``experts``' adapter on ``weight``."""
    return f"{experts}.{EXPERTS_ADAPTER}.{part}.{weight}"


def adapter_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of ``module``'s adapters (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``; for
    stacked experts ``<experts>.lora.lora_A.<weight>``, ``<experts>.lora.lora_B.<weight>``)."""
    linear = [f"{name}.{part}.weight" for name in lora_layers(module) for part in ADAPTER_PARTS]
    stacked = [
        _factor_key(experts, part, weight)
        for experts, adapter in expert_adapters(module).items()
        for weight in adapter.weights
        for part in ADAPTER_PARTS
    ]
    return linear + stacked


class MergeLoRA(ModelStateMapper):
    """Per adapted layer one group ``(weight, lora_A.weight, lora_B.weight) -> weight``: the base weight plus the
    scaled low-rank update, computed in float32 and cast back to the weight's dtype. ``scalings``: layer name ->
    ``alpha / rank``. ``stacked``: per adapted stacked-experts weight (``<experts>.<weight>``) its ``(alpha / rank,
    out_first)``; its group ``(weight, <experts>.lora.lora_A.<weight>, ...lora_B.<weight>) -> weight`` adds
    ``B_e A_e`` to each expert's matrix, transposed where the weight holds ``[E, in, out]``."""

    def __init__(
        self, scalings: Mapping[str, float], stacked: Mapping[str, tuple[float, bool]] | None = None
    ) -> None:
        self.scalings = dict(scalings)
        self.stacked = dict(stacked or {})

    def groups(self) -> list[Group]:
        linear = [
            Group((f"{name}.weight", f"{name}.lora_A.weight", f"{name}.lora_B.weight"), (f"{name}.weight",))
            for name in self.scalings
        ]
        stacked = []
        for key in self.stacked:
            experts, _, weight = key.rpartition(".")
            factors = tuple(_factor_key(experts, part, weight) for part in ADAPTER_PARTS)
            stacked.append(Group((key, *factors), (key,)))
        return linear + stacked

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        group = self.group_for(inputs)
        weight_key, a_key, b_key = group.inputs
        weight, a, b = inputs[weight_key], inputs[a_key], inputs[b_key]
        if weight_key in self.stacked:
            scaling, out_first = self.stacked[weight_key]
            update = scaling * torch.bmm(b.float(), a.float())  # [E, out, in]
            if not out_first:
                update = update.transpose(1, 2)
        else:
            update = self.scalings[weight_key.removesuffix(".weight")] * (b.float() @ a.float())
        return {weight_key: (weight.float() + update).to(weight.dtype)}

    def __repr__(self) -> str:
        return f"MergeLoRA({len(self.scalings)} layers, {len(self.stacked)} stacked expert weights)"


def merge_mapper(module: nn.Module) -> MergeLoRA | None:
    """What folds ``module``'s adapters into their base weights on the way out; None without adapters."""
    layers = lora_layers(module)
    stacked = {
        f"{experts}.{weight}": (adapter.scaling, layout.out_first)
        for experts, adapter in expert_adapters(module).items()
        for weight, layout in adapter.weights.items()
    }
    if not layers and not stacked:
        return None
    return MergeLoRA({name: layer.scaling for name, layer in layers.items()}, stacked)


@dataclass(frozen=True)
class _Adapted:
    """One adapted layer or stacked weight as peft records it; for a stacked weight also the experts module's
    name, the weight's and the number of wrappers peft puts around its own (``nesting``)."""

    rank: int
    alpha: float
    dropout: float
    experts: str | None = None
    weight: str = ""
    nesting: int = 0


def _dropout(layer: nn.Module) -> float:
    return float(getattr(layer.lora_dropout, "p", 0.0))


def _settings(module: nn.Module, gather: bool) -> dict[str, _Adapted]:
    """Each adapted layer (by its name) and stacked weight (``<experts>.<weight>``) as peft records it; with
    ``gather``, every rank's (pipeline stages)."""
    mine = {
        name: _Adapted(layer.rank, layer.alpha, _dropout(layer))
        for name, layer in lora_layers(module).items()
    }
    for experts, adapter in expert_adapters(module).items():
        weights = list(adapter.weights)  # the experts module's parameter order: the last one outermost
        for position, weight in enumerate(weights):
            nesting = len(weights) - 1 - position
            mine[f"{experts}.{weight}"] = _Adapted(
                adapter.rank, adapter.alpha, _dropout(adapter), experts, weight, nesting
            )
    if not (gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    every: list[dict[str, _Adapted] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: value for part in every for name, value in (part or {}).items()}


def peft_adapter_config(
    module: nn.Module, base_model_name_or_path: str | None = None, *, partial: bool = False
) -> dict[str, Any]:
    """``adapter_config.json`` for ``module``'s adapters: ``peft``'s LoRA fields, the adapted layers named in
    full in ``target_modules`` (peft matches a name or its suffix), adapted stacked-experts weights in
    ``target_parameters`` (``<experts>.<weight>``), a rank or alpha that differs from the most common one per
    layer in ``rank_pattern`` / ``alpha_pattern``. ``partial``: every rank's layers (a collective). Raises
    ``CheckpointError`` when the adapters cannot be expressed (dropout differs between layers: peft keeps one;
    dropout with adapted experts: peft's wrapper of a parameter takes none)."""
    return _peft_config(type(module).__name__, _settings(module, partial), base_model_name_or_path)


def _peft_config(
    model: str, settings: Mapping[str, _Adapted], base_model_name_or_path: str | None
) -> dict[str, Any]:
    if not settings:
        raise CheckpointError(
            f"{model} has no LoRA adapters: train with D9DStrategy(lora=LoRA(...)) to export one"
        )
    rank = Counter(s.rank for s in settings.values()).most_common(1)[0][0]
    alpha = Counter(s.alpha for s in settings.values()).most_common(1)[0][0]
    dropouts = {s.dropout for s in settings.values()}
    if len(dropouts) > 1:
        raise CheckpointError(
            f"the adapters use several dropout rates ({sorted(dropouts)}); a peft adapter keeps one: export the "
            "merged weights instead"
        )
    dropout = dropouts.pop()
    parameters = sorted(name for name, s in settings.items() if s.experts is not None)
    if parameters and dropout:
        raise CheckpointError(
            f"the adapters of stacked experts ({parameters[0]}, ...) train with dropout {dropout}; peft adapts "
            "stacked experts through target_parameters, which take no dropout: export the merged weights instead, "
            "or train with LoRA(dropout=0.0)"
        )
    extra: dict[str, Any] = {"target_parameters": parameters} if parameters else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(name for name, s in settings.items() if s.experts is None),
        **extra,
        "rank_pattern": {name: s.rank for name, s in sorted(settings.items()) if s.rank != rank},
        "alpha_pattern": {name: s.alpha for name, s in sorted(settings.items()) if s.alpha != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


class PeftExpertFactors(ModelStateMapper):
    """Each side of a stacked weight's per-expert adapters (``[E, r, in]`` / ``[E, out, r]``, by key: which side
    and the weight's record) -> peft's ``lora_A.weight [E * r, in]`` / ``lora_B.weight [out, r * E]`` under its
    nested name (module docstring)."""

    def __init__(self, factors: Mapping[str, tuple[str, _Adapted]]) -> None:
        self.factors = dict(factors)

    @staticmethod
    def peft_key(part: str, adapted: _Adapted) -> str:
        return f"{PEFT_PREFIX}{adapted.experts}.{'base_layer.' * adapted.nesting}{part}.weight"

    def groups(self) -> list[Group]:
        return [Group((key,), (self.peft_key(*value),)) for key, value in self.factors.items()]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        ((key, factor),) = inputs.items()
        self.group_for(inputs)
        part, adapted = self.factors[key]
        if part == "lora_A":  # [E, r, in] -> [E * r, in]: expert-major rows
            flat = factor.reshape(-1, factor.shape[-1])
        else:  # [E, out, r] -> [out, r * E]: column j * E + e is expert e's column j
            flat = factor.permute(1, 2, 0).reshape(factor.shape[1], -1)
        return {self.peft_key(part, adapted): flat.contiguous()}

    def __repr__(self) -> str:
        return f"PeftExpertFactors({len(self.factors)} factors)"


def save_peft_adapter(
    module: nn.Module,
    directory: str | os.PathLike[str],
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    partial: bool = False,
) -> Path:
    """Write ``module``'s adapters as a ``peft`` adapter directory (module docstring). A collective in a multi-rank
    run, like ``save_hf``: every rank calls it; ``partial``: each rank holds part of the model (pipeline stages).
    ``base_model_name_or_path`` is recorded for ``peft`` (the base model's folder or Hub name); ``dtype`` casts
    the adapters (default: as they are)."""
    settings = _settings(module, partial)
    config = _peft_config(type(module).__name__, settings, base_model_name_or_path)
    tensors, _ = module_tensors(module)
    mapper = peft_mapper(settings, dtype, present=tensors)
    mine = mapper.input_keys()
    return save_from_module(
        module,
        directory,
        mapper,
        extra_files={ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"},
        partial=partial,
        leave=frozenset(tensors) - frozenset(mine),
        single_file=ADAPTER_WEIGHTS,
    )


def peft_mapper(
    settings: Mapping[str, _Adapted],
    dtype: torch.dtype | None = None,
    *,
    present: Collection[str] | None = None,
) -> ModelStateMapper:
    """Adapter keys (``<layer>.lora_A.weight``, ``<experts>.lora.lora_A.<weight>``, ...) -> peft's, for the
    adapters ``settings`` describes; cast to ``dtype`` if given. ``present``: the keys this rank holds (a pipeline
    stage's), to which the adapted layers' keys are limited."""
    linear = [
        key
        for name, s in settings.items()
        if s.experts is None
        for key in (f"{name}.{part}.weight" for part in ADAPTER_PARTS)
        if present is None or key in present
    ]
    stacked = {
        _factor_key(s.experts, part, s.weight): (part, s)
        for s in settings.values()
        if s.experts is not None
        for part in ADAPTER_PARTS
    }
    mapper: ModelStateMapper = Parallel(
        [Rename({key: PEFT_PREFIX + key for key in linear}), PeftExpertFactors(stacked)]
    )
    if dtype is not None:
        mapper = chain(mapper, Cast(mapper.output_keys(), dtype, floating_only=True))
    return mapper


def recorded_adapters(
    keys: Collection[str], *, rank: int, alpha: float, dropout: float, expert_layouts: Mapping[str, bool]
) -> dict[str, _Adapted]:
    """The adapters among a training checkpoint's model ``keys``, as peft records them, from the LoRA settings the
    checkpoint records (``state/frozen.py``): every layer with a ``lora_A.weight``, and every stacked-experts
    weight of ``expert_layouts`` (in the experts module's parameter order, which sets peft's nesting)."""
    by_experts: dict[str, list[str]] = {}
    for name in expert_layouts:
        experts, _, weight = name.rpartition(".")
        by_experts.setdefault(experts, []).append(weight)
    found: dict[str, _Adapted] = {}
    for experts, weights in by_experts.items():
        for position, weight in enumerate(weights):
            nesting = len(weights) - 1 - position
            found[f"{experts}.{weight}"] = _Adapted(rank, alpha, dropout, experts, weight, nesting)
    factors = {
        _factor_key(s.experts, part, s.weight)
        for s in found.values()
        if s.experts is not None
        for part in ADAPTER_PARTS
    }
    suffix = ".lora_A.weight"
    for key in keys:
        if key.endswith(suffix) and key not in factors:
            found[key.removesuffix(suffix)] = _Adapted(rank, alpha, dropout)
    return found


def recorded_peft_config(
    settings: Mapping[str, _Adapted], base_model_name_or_path: str | None, *, source: str
) -> dict[str, Any]:
    """``adapter_config.json`` for the adapters ``settings`` describes (:func:`recorded_adapters`); ``source``
    names where they come from in errors."""
    return _peft_config(source, settings, base_model_name_or_path)
