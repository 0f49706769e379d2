"""What a handed Hugging Face config may not do: make ``transformers`` fetch or import code.

A config may come from a file someone handed over (an HF directory's ``config.json``, a training checkpoint's
``meta.pt``). ``transformers`` reads some of its fields as instructions: ``attn_implementation="org/repo@rev"``
downloads and imports a Hub kernel, ``auto_map`` names remote modelling code, ``quantization_config`` loads a
quantizer (some fetch kernels too). :func:`without_code_fields` drops them, at any depth, before a model is built
from a config and before a config is written beside exported weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Fields transformers acts on by fetching or importing code; any field naming an "_implementation" (attention,
# experts, their private copies) is one too.
CODE_FIELDS = frozenset({"auto_map", "quantization_config", "kernel_config", "use_kernels"})


def is_code_field(name: object) -> bool:
    return isinstance(name, str) and (name in CODE_FIELDS or "_implementation" in name)


def code_fields(config: Mapping[str, Any], within: str = "") -> list[str]:
    """The dotted names of the code fields of ``config``, nested configs included."""
    found: list[str] = []
    for name, value in config.items():
        if is_code_field(name):
            found.append(within + name)
        elif isinstance(value, Mapping):
            found.extend(code_fields(value, f"{within}{name}."))
    return found


def without_code_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without its code fields, nested configs included."""
    return {
        name: without_code_fields(value) if isinstance(value, Mapping) else value
        for name, value in config.items()
        if not is_code_field(name)
    }
