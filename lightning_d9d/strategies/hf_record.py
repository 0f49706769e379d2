"""What ``python -m lightning_d9d.convert dcp-to-hf`` needs from a training checkpoint besides the tensors: the
model's Hugging Face config, recorded at save time whenever the model has one (``config.to_hf_dict()``), so the
conversion needs no ``--config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_d9d.state.hf import module_hf_config
from lightning_d9d.state.hf.transformers import is_transformers_module
from lightning_d9d.state.training import HF_CONFIG_KEY


def model_hf_config(module: nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config of the model inside ``module``: the one config among its submodules (itself
    included) with ``config.to_hf_dict()``, or of its outermost ``transformers`` model (the causal LM, not its
    base model inside); None if there is none, or several that differ (then no single answer exists and
    ``convert`` asks for ``--config``)."""
    found: list[dict[str, Any]] = []
    inside_transformers: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside_transformers:
            continue
        if is_transformers_module(sub):
            inside_transformers.update(id(child) for child in sub.modules())
        elif not callable(getattr(getattr(sub, "config", None), "to_hf_dict", None)):
            continue
        config = module_hf_config(sub)
        if config not in found:
            found.append(config)
    return found[0] if len(found) == 1 else None


def with_hf_config(checkpoint: Mapping[str, Any], module: nn.Module | None) -> dict[str, Any]:
    """``checkpoint`` plus the model's Hugging Face config under ``"hf_config"`` (unless it has one already)."""
    config = None if module is None or HF_CONFIG_KEY in checkpoint else model_hf_config(module)
    return dict(checkpoint) if config is None else {**checkpoint, HF_CONFIG_KEY: config}
