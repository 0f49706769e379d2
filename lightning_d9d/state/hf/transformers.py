"""The Hugging Face format of a ``transformers`` model itself: its files and its module, whatever the family.

A ``transformers`` causal LM holds (mostly) the names and layout of its own files, so its format is built from
the module rather than looked up (:func:`transformers_format`):

- a family we have a format for (``qwen3``, ``qwen3_moe``): that format, read through to the module's own layout.
  Files in any layout the format knows map onto our layout and from there onto the layout the module holds
  (:meth:`~.registry.HFFormat.layout_of` its keys): identity for Qwen3; for ``transformers``' Qwen3-MoE the per-expert files
  ``save_pretrained`` writes are stacked into its fused ``gate_up_proj`` / ``down_proj`` and split back on export;
- any other family (Llama, Mistral, ...): the identity on the model's state-dict keys (``transformers`` 5 writes a
  dense model's in-memory names unchanged), tied weights as the model ties them, and a signature of the config
  fields that shape the weights and the forward.

The keys are the whole model's, built from its config on ``meta`` (a pipeline rank's model holds only its stages).

Nothing here imports ``transformers``: a model is recognised by its classes' module names.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import torch
from torch import nn

from ..compose import chain
from ..errors import CheckpointError
from ..mapper import Identity, ModelStateMapper
from ..module_io import module_tensors
from .registry import HFConfig, HFFormat, hf_format
from .untrusted import without_code_fields

# The config fields that shape a decoder's weights or forward, where a family has them (the signature of a
# family without a format of ours).
SIGNATURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "sliding_window",
    "layer_types",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def is_transformers_module(module: object) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (by its classes' module names: no import)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def _made_by_torch_at_runtime(cls: type) -> bool:
    """Whether ``cls`` is a class torch made while wrapping a module (not one defined in its source)."""
    if cls.__module__.split(".")[0] != "torch" or len(cls.__bases__) < 2:
        return False
    try:
        defined = functools.reduce(getattr, cls.__qualname__.split("."), sys.modules[cls.__module__])
    except (AttributeError, KeyError):
        return True
    return defined is not cls


def declared_class(module: nn.Module) -> type:
    """The class ``module`` was built as, whatever torch wrapped it in since: ``fully_shard`` swaps a module's
    class for ``FSDP<Name>``, ``replicate`` for ``DDP<Name>``, each made at runtime with the wrapper and the
    module's class as bases. Its name is what checkpoints record and exports write in ``architectures``."""
    cls = type(module)
    while _made_by_torch_at_runtime(cls):
        cls = cls.__bases__[-1]  # the class it replaced comes last
    return cls


def transformers_hf_config(module: nn.Module) -> dict[str, Any]:
    """The ``config.json`` of a ``transformers`` model, naming its class among ``architectures`` as
    ``save_pretrained`` does."""
    config: Any = getattr(module, "config")  # noqa: B009  (a transformers config, untyped here)
    content = dict(config.to_dict())
    content["architectures"] = [declared_class(module).__name__]
    return content


def transformers_format(module: nn.Module, config: HFConfig) -> HFFormat:
    """The format between ``config``'s files and ``module`` (a ``transformers`` model; see the module docstring)."""
    tensors, aliases = whole_model_tensors(module)
    keys = sorted(tensors)
    try:
        family = hf_format(config)
    except CheckpointError:
        family = None
    if family is None:
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        return HFFormat(
            model_type=str(config.get("model_type")),
            architectures=(declared_class(module).__name__,),
            mapping=lambda _config, _layout: Identity(keys),
            signature=_signature,
            # the files hold the module's keys: their shapes are the module's, as built from the config
            hf_shapes=lambda _config, _layout: dict(shapes),
            tied=lambda _config: dict(aliases),
            from_transformers=True,
        )
    held = family.layout_of(list(tensors))  # the layout the module holds

    def read_into_module(file_config: HFConfig, layout: str | None) -> ModelStateMapper:
        # files (layout) -> ours -> the layout the module holds
        return chain(family.from_hf(file_config, layout), family.to_hf(file_config, held))

    return HFFormat(
        model_type=family.model_type,
        architectures=(*family.architectures, declared_class(module).__name__),
        mapping=read_into_module,
        signature=family.signature,
        hf_shapes=family.hf_shapes,
        tied=family.tied,
        layouts=family.layouts,
        detect_layout=family.detect_layout,
        from_transformers=True,
    )


def transformers_model_format(config: HFConfig, config_path: str = "the config") -> HFFormat:
    """The format of the ``transformers`` class ``config`` names (its ``architectures``), built on ``meta`` from
    the config alone: for a training checkpoint of a ``transformers`` model, converted offline. Imports
    ``transformers``, which only such a conversion needs. ``config_path`` names the config in errors."""
    architectures = list(config.get("architectures") or [])
    try:
        import transformers
    except ImportError as missing:
        raise CheckpointError(
            f"the config names {architectures or config.get('model_type')!r}, which no format of ours covers; "
            "converting a transformers model's checkpoint needs transformers (pip install 'lightning-d9d[transformers]')"
        ) from missing
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    # a name read from a file: only a transformers model class is built from it, nothing else the package holds
    if not isinstance(model_class, type) or not issubclass(model_class, transformers.PreTrainedModel):
        raise CheckpointError(
            f"the config's architectures ({architectures}) name no transformers model class, and its model_type "
            f"{config.get('model_type')!r} has no format of ours: pass --config with the model's config.json"
        )
    # The config is read from a file: no field that makes transformers fetch or import code reaches it, the
    # attention is its own eager one, and the dtype (which it would look up in torch by name) is the export's.
    fields = {
        key: value
        for key, value in without_code_fields(config).items()
        if key not in ("architectures", "model_type", "dtype", "torch_dtype")
    }
    try:
        hf_config = transformers.AutoConfig.for_model(
            str(config["model_type"]), attn_implementation="eager", **fields
        )
        with torch.device("meta"):
            module = model_class(hf_config)
    # whatever transformers raises on a field it cannot use (KeyError, ZeroDivisionError, its own validation
    # errors, ...) is an error of the config's
    except Exception as error:
        raise CheckpointError(
            f"transformers cannot build {model_class.__name__} from {config_path}: {type(error).__name__}: {error}"
        ) from error
    return transformers_format(module, config)


def whole_model_tensors(module: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """:func:`~lightning_d9d.state.module_io.module_tensors` of the whole model ``module`` is (or was: a pipeline
    rank's model holds its stages only), built from its config on ``meta``: every key, and its ties."""
    model_class = next(
        cls for cls in declared_class(module).__mro__ if cls.__module__.startswith("transformers.")
    )
    config = copy.deepcopy(getattr(module, "config"))  # noqa: B009  (untyped here)
    with torch.device("meta"):
        whole = model_class(config)
    return module_tensors(whole)


def _signature(config: HFConfig) -> dict[str, Any]:
    if "model_type" not in config:
        raise KeyError("model_type")
    return {field: config.get(field) for field in ("model_type", *SIGNATURE_FIELDS) if field in config}
