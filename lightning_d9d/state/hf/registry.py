"""Hugging Face model formats: for each model family, the mapping between its HF files and our module, and the
fields of its ``config.json`` that define the architecture.

A format is looked up by the ``model_type`` of a config (``"qwen3"``), or failing that by its ``architectures``
(``"Qwen3ForCausalLM"``). Everything takes the HF config as a plain dict (a ``config.json``, or what a model
config's ``to_hf_dict()`` returns): this layer knows nothing of ``lightning_d9d.models``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import CheckpointError, CheckpointFileError, ConfigMismatchError
from ..mapper import ModelStateMapper
from .untrusted import without_code_fields

CONFIG_NAME = "config.json"

HFConfig = Mapping[str, Any]


@runtime_checkable
class HasHFConfig(Protocol):
    """A model config that can describe itself as a Hugging Face ``config.json`` (e.g. ``Qwen3Config``)."""

    def to_hf_dict(self) -> dict[str, Any]: ...


def hf_dict(config: HFConfig | HasHFConfig | Any) -> dict[str, Any]:
    """A plain dict from a ``config.json`` dict, a config with ``to_hf_dict()``, or a ``transformers`` config."""
    if isinstance(config, Mapping):
        return dict(config)
    for method in ("to_hf_dict", "to_dict"):  # ours, then transformers' PretrainedConfig
        convert = getattr(config, method, None)
        if callable(convert):
            return dict(convert())
    raise TypeError(
        f"expected a Hugging Face config (a dict, or an object with to_hf_dict()), got {type(config).__name__}"
    )


def _no_ties(config: HFConfig) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class HFFormat:
    """How one model family maps between its Hugging Face files and our module.

    ``mapping(config, layout)`` is the graph from the HF file keys to the module's keys (tied weights once, under
    the name ``state_dict()`` lists first); its inverse exports. ``layouts`` names the file layouts a family has
    had (transformers changed how MoE experts are stored, for instance): ``detect_layout`` tells them apart from a
    file's keys, and the first one is what we write by default. ``signature`` extracts the fields that define the
    architecture, normalised so that two configs of the same model compare equal whatever transformers version
    wrote them. ``tied`` names the keys that are copies of others when the config ties them (a file or a
    training checkpoint may hold them anyway; they are not read). ``from_transformers``: the format of a
    ``transformers`` model's own module (its class's names and layout), not one of our registered families.
    """

    model_type: str
    architectures: tuple[str, ...]
    mapping: Callable[[HFConfig, str | None], ModelStateMapper]
    signature: Callable[[HFConfig], dict[str, Any]]
    hf_shapes: Callable[[HFConfig, str | None], dict[str, tuple[int, ...]]] | None = None
    tied: Callable[[HFConfig], dict[str, str]] = _no_ties
    layouts: tuple[str, ...] = ()
    detect_layout: Callable[[Collection[str]], str | None] | None = None
    # Built from a transformers model's own module (state/hf/transformers.py): its keys are the class's
    from_transformers: bool = False

    def from_hf(self, config: HFConfig, layout: str | None = None) -> ModelStateMapper:
        """HF file keys → module keys."""
        return self.mapping(config, self.resolve_layout(layout))

    def to_hf(self, config: HFConfig, layout: str | None = None) -> ModelStateMapper:
        """Module keys → HF file keys."""
        return self.from_hf(config, layout).inverse()

    def layout_of(self, keys: Collection[str]) -> str | None:
        """The layout of a file with these keys (``None`` for a family with one layout)."""
        if not self.layouts:
            return None
        found = self.detect_layout(keys) if self.detect_layout is not None else None
        return found or self.layouts[0]

    def resolve_layout(self, layout: str | None) -> str | None:
        """``layout``, checked, or the default one."""
        if layout is None:
            return self.layouts[0] if self.layouts else None
        if layout not in self.layouts:
            known = ", ".join(self.layouts) or "none: it has a single layout"
            raise CheckpointError(f"{self.model_type}: unknown layout {layout!r} (known: {known})")
        return layout


_FORMATS: dict[str, HFFormat] = {}


def register_hf_format(fmt: HFFormat) -> HFFormat:
    """Make ``fmt`` known under its ``model_type`` (registering a type again replaces it)."""
    _FORMATS[fmt.model_type] = fmt
    return fmt


def hf_formats() -> dict[str, HFFormat]:
    return dict(_FORMATS)


def hf_format(config: HFConfig | str) -> HFFormat:
    """The format of a config (by ``model_type``, else ``architectures``), or of a ``model_type`` name."""
    model_type: Any
    architectures: list[Any]
    if isinstance(config, str):
        model_type, architectures = config, []
    else:
        model_type, architectures = config.get("model_type"), list(config.get("architectures") or [])
    if model_type in _FORMATS:
        return _FORMATS[model_type]
    for fmt in _FORMATS.values():
        if any(name in fmt.architectures for name in architectures):
            return fmt
    known = ", ".join(f"{t} ({', '.join(f.architectures)})" for t, f in sorted(_FORMATS.items()))
    raise CheckpointError(
        f"no Hugging Face mapping for model_type {model_type!r} (architectures {architectures}); known: {known}"
    )


# ------------------------------------------------------------------------------------------- config.json
def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of an HF directory (or the file itself), with errors that name the path."""
    given = Path(path)
    file = given / CONFIG_NAME if given.is_dir() else given
    if not file.is_file():
        raise CheckpointFileError(
            f"{file} does not exist: a Hugging Face checkpoint directory holds its config.json beside the weights",
            path=str(file),
        )
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointFileError(f"{file} is not valid JSON: {error}", path=str(file)) from error
    if not isinstance(config, dict):
        raise CheckpointFileError(f"{file} must hold a JSON object", path=str(file))
    return config


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as transformers writes it."""
    return str(dtype).removeprefix("torch.")


def hf_config_json(config: HFConfig, *, dtype: torch.dtype | None = None) -> str:
    """The text of a ``config.json``; ``dtype`` (that of the weights written beside it) under both names
    transformers has used (``torch_dtype`` up to 4.55, ``dtype`` since). Without the fields that make
    ``transformers`` fetch or import code (:func:`~.untrusted.without_code_fields`): the config may come from a
    handed checkpoint, and every later ``from_pretrained`` of the export would act on them."""
    content = without_code_fields(config)
    if dtype is not None:
        content["torch_dtype"] = content["dtype"] = dtype_name(dtype)
    return json.dumps(content, indent=2, sort_keys=False, default=str) + "\n"


def check_same_model(
    found: HFConfig,
    expected: HFConfig,
    *,
    path: str,
    expected_name: str = "the module",
    fmt: HFFormat | None = None,
) -> None:
    """Raise ``ConfigMismatchError`` unless ``found`` (a checkpoint's config) describes the model ``expected``
    describes: the same format (``fmt``, default: ``expected``'s registered one), and the same value for every
    field of its signature. The message lists each differing field with both values."""
    expected_format = fmt if fmt is not None else hf_format(expected)
    if fmt is not None:
        same = found.get("model_type") == fmt.model_type or bool(
            set(found.get("architectures") or ()) & set(fmt.architectures)
        )
        found_format = expected_format if same else None
    else:
        try:
            found_format = hf_format(found)
        except CheckpointError:
            found_format = None
    if found_format is not expected_format:
        fields = {"model_type": (found.get("model_type"), expected.get("model_type"))}
        raise ConfigMismatchError(
            f"{path} describes another model: model_type {found.get('model_type')!r} (architectures "
            f"{found.get('architectures')}), but {expected_name} is {expected_format.model_type!r}",
            path=path,
            fields=fields,
        )
    ours = expected_format.signature(expected)
    try:
        theirs = expected_format.signature(found)
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigMismatchError(
            f"{path} is not a complete {expected_format.model_type} config: cannot read field {error}",
            path=path,
            fields={str(error): (None, None)},
        ) from error
    differing = {name: (theirs.get(name), value) for name, value in ours.items() if theirs.get(name) != value}
    if differing:
        listed = "; ".join(
            f"{name} is {file!r} there but {mine!r} in {expected_name}"
            for name, (file, mine) in differing.items()
        )
        raise ConfigMismatchError(f"{path} describes another model: {listed}", path=path, fields=differing)
