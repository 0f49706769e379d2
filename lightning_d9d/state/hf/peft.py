"""LoRA adapters out of a training run, in the two forms the Hugging Face tools load.

- **Merged**: each adapted layer's weight written as ``W + (alpha / r) B A`` (:class:`MergeLoRA`, composed before
  the model's own format by ``save_hf``): a plain model directory that ``transformers`` loads as it is.
- **A peft adapter directory** (:func:`save_peft_adapter`): ``adapter_config.json`` and
  ``adapter_model.safetensors`` under ``peft``'s names (``base_model.model.<layer>.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the ``transformers`` base model.

Both stream through the same writer as every export (any mesh; each tensor gathered when its group is written).
An adapted layer is a :class:`~lightning_d9d.modules.lora.LoRALinear`; its state-dict keys are the base layer's
plus ``lora_A.weight`` / ``lora_B.weight``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_d9d.modules.lora import LoRALinear

from ..compose import chain
from ..errors import CheckpointError
from ..mapper import Cast, Group, ModelStateMapper, Rename
from ..module_io import module_tensors, save_from_module

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's names: the transformers model sits at base_model.model of a PeftModel
PEFT_PREFIX = "base_model.model."
ADAPTER_PARTS = ("lora_A", "lora_B")


def lora_layers(module: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers of ``module``, by name relative to it."""
    return {name: child for name, child in module.named_modules() if isinstance(child, LoRALinear)}


def adapter_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of ``module``'s adapters (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``)."""
    return [f"{name}.{part}.weight" for name in lora_layers(module) for part in ADAPTER_PARTS]


class MergeLoRA(ModelStateMapper):
    """Per adapted layer one group ``(weight, lora_A.weight, lora_B.weight) -> weight``: the base weight plus the
    scaled low-rank update, computed in float32 and cast back to the weight's dtype. ``scalings``: layer name ->
    ``alpha / rank``."""

    def __init__(self, scalings: Mapping[str, float]) -> None:
        self.scalings = dict(scalings)

    def groups(self) -> list[Group]:
        return [
            Group((f"{name}.weight", f"{name}.lora_A.weight", f"{name}.lora_B.weight"), (f"{name}.weight",))
            for name in self.scalings
        ]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        group = self.group_for(inputs)
        weight_key, a_key, b_key = group.inputs
        name = weight_key.removesuffix(".weight")
        weight, a, b = inputs[weight_key], inputs[a_key], inputs[b_key]
        update = self.scalings[name] * (b.float() @ a.float())
        return {weight_key: (weight.float() + update).to(weight.dtype)}

    def __repr__(self) -> str:
        return f"MergeLoRA({len(self.scalings)} layers)"


def merge_mapper(module: nn.Module) -> MergeLoRA | None:
    """What folds ``module``'s adapters into their base weights on the way out; None without adapters."""
    layers = lora_layers(module)
    return MergeLoRA({name: layer.scaling for name, layer in layers.items()}) if layers else None


def _settings(module: nn.Module, gather: bool) -> dict[str, tuple[int, float, float]]:
    """Each adapted layer's ``(rank, alpha, dropout)``; with ``gather``, every rank's layers (pipeline stages)."""
    mine = {
        name: (layer.rank, layer.alpha, float(getattr(layer.lora_dropout, "p", 0.0)))
        for name, layer in lora_layers(module).items()
    }
    if not (gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    every: list[dict[str, tuple[int, float, float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: value for part in every for name, value in (part or {}).items()}


def peft_adapter_config(
    module: nn.Module, base_model_name_or_path: str | None = None, *, partial: bool = False
) -> dict[str, Any]:
    """``adapter_config.json`` for ``module``'s adapters: ``peft``'s LoRA fields, the adapted layers named in
    full in ``target_modules`` (peft matches a name or its suffix), a rank or alpha that differs from the most
    common one per layer in ``rank_pattern`` / ``alpha_pattern``. ``partial``: every rank's layers (a collective).
    Raises ``CheckpointError`` when the adapters cannot be expressed (dropout differs between layers: peft keeps
    one)."""
    settings = _settings(module, partial)
    if not settings:
        raise CheckpointError(
            f"{type(module).__name__} has no LoRA adapters: train with D9DStrategy(lora=LoRA(...)) to export one"
        )
    rank = Counter(r for r, _, _ in settings.values()).most_common(1)[0][0]
    alpha = Counter(a for _, a, _ in settings.values()).most_common(1)[0][0]
    dropouts = {d for _, _, d in settings.values()}
    if len(dropouts) > 1:
        raise CheckpointError(
            f"the adapters use several dropout rates ({sorted(dropouts)}); a peft adapter keeps one: export the "
            "merged weights instead"
        )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(),
        "target_modules": sorted(settings),
        "rank_pattern": {name: r for name, (r, _, _) in sorted(settings.items()) if r != rank},
        "alpha_pattern": {name: a for name, (_, a, _) in sorted(settings.items()) if a != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


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
    config = peft_adapter_config(module, base_model_name_or_path, partial=partial)
    tensors, _ = module_tensors(module)
    mine = [key for key in tensors if key.rpartition(".lora_")[0] in config["target_modules"]]
    mapper: ModelStateMapper = Rename({key: PEFT_PREFIX + key for key in mine})
    if dtype is not None:
        mapper = chain(mapper, Cast(mapper.output_keys(), dtype, floating_only=True))
    return save_from_module(
        module,
        directory,
        mapper,
        extra_files={ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"},
        partial=partial,
        leave=frozenset(tensors) - frozenset(mine),
        single_file=ADAPTER_WEIGHTS,
    )
