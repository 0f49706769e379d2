"""What a handed Hugging Face config may not do: make ``transformers`` fetch or import code, or drive work that the
files beside it do not justify.

A config may come from a file someone handed over (an HF directory's ``config.json``, a training checkpoint's
``meta.pt``). ``transformers`` reads some of its fields as instructions: ``attn_implementation="org/repo@rev"``
downloads and imports a Hub kernel, ``auto_map`` names remote modelling code, ``quantization_config`` loads a
quantizer (some fetch kernels too). :func:`without_code_fields` drops them, at any depth, before a model is built
from a config and before a config is written beside exported weights. :func:`check_layer_count` bounds the layer
count by the layers the files hold, and :func:`check_expert_count` the expert count by the experts they hold, before
anything is built per layer or per expert.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from ..errors import ConfigMismatchError

# Fields transformers acts on by fetching or importing code; any field naming an "_implementation" (attention,
# experts, their private copies) is one too.
CODE_FIELDS = frozenset({"auto_map", "quantization_config", "kernel_config", "use_kernels"})
# The fields that count layers: a model built from a config makes that many blocks.
LAYER_COUNT_FIELDS = ("num_hidden_layers",)
# The fields that count routed experts (transformers 4.x, 5.x and DeepSeek's names): a mapper makes that many
# entries per MoE layer.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


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


def _counts(
    config: Mapping[str, Any], fields: tuple[str, ...], within: str = ""
) -> Iterator[tuple[str, object]]:
    for name, value in config.items():
        if name in fields:
            yield within + name, value
        elif isinstance(value, Mapping):
            yield from _counts(value, fields, f"{within}{name}.")


def _check_count(name: str, value: object, config_path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigMismatchError(
            f"{config_path}: {name} must be a non-negative integer, not {value!r}",
            path=config_path,
            fields={name: (value, None)},
        )
    return value


def numbered_blocks(keys: Collection[str]) -> dict[str, list[int]]:
    """The numbered blocks the keys hold, by the name before the number (``"model.layers."`` → ``[0, 1]``): the
    first all-digit part of each key."""
    blocks: dict[str, set[int]] = {}
    for key in keys:
        parts = key.split(".")
        position = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if position is not None:
            stem = ".".join(parts[:position]) + "." if position else ""
            blocks.setdefault(stem, set()).add(int(parts[position]))
    return {stem: sorted(numbers) for stem, numbers in sorted(blocks.items())}


def _described(blocks: dict[str, list[int]]) -> str:
    shown = [f"{stem + str(numbers[0])!r} to {stem + str(numbers[-1])!r}" for stem, numbers in blocks.items()]
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def check_layer_count(
    config: Mapping[str, Any], keys: Collection[str], *, config_path: str, source: str
) -> None:
    """Every layer count of ``config`` (``num_hidden_layers``, nested configs' too) is a non-negative integer no
    larger than the number of numbered blocks ``keys`` hold (the tensors of ``source``), or, when none is
    numbered, than the number of tensors (each layer holds at least one). Checked from the keys alone, before a
    module or a per-layer mapper is built from the count: a crafted count would make that unbounded work."""
    blocks = numbered_blocks(keys)
    held = sum(len(numbers) for numbers in blocks.values())
    for name, value in _counts(config, LAYER_COUNT_FIELDS):
        value = _check_count(name, value, config_path)
        if blocks and value > held:
            raise ConfigMismatchError(
                f"{config_path}: {name} ({value}) is more than the {held} layers {source} holds "
                f"({_described(blocks)}): the config of another model?",
                path=config_path,
                fields={name: (value, held)},
            )
        if not blocks and value > len(keys):
            raise ConfigMismatchError(
                f"{config_path}: {name} ({value}) is more than the {len(keys)} tensors {source} holds (a layer "
                "holds at least one): the config of another model?",
                path=config_path,
                fields={name: (value, len(keys))},
            )


def held_experts(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many experts the tensors ``shapes`` names hold, at most: one past the largest number after an
    ``experts`` part of a key (one tensor per expert: ``mlp.experts.7.down_proj.weight``), or the leading size of a
    non-empty tensor under an ``experts`` part (the experts stacked: ``mlp.experts.down_proj``), the larger."""
    held = 0
    for key, shape in shapes.items():
        parts = key.split(".")
        for position, part in enumerate(parts[:-1]):
            if part != "experts":
                continue
            following = parts[position + 1]
            if following.isdigit():
                held = max(held, int(following) + 1)
            elif shape and math.prod(shape) > 0:
                held = max(held, shape[0])
    return held


def check_expert_count(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, config_path: str, source: str
) -> None:
    """Every expert count of ``config`` (``num_experts``, ``num_local_experts``, ``n_routed_experts``, nested
    configs' too) is a non-negative integer no larger than the experts the tensors of ``source`` hold
    (:func:`held_experts`, from the names and shapes alone), before a per-expert mapper is built from it: a crafted
    count would make that unbounded work (three million experts: 85 s of mapping before the shapes disagree)."""
    held: int | None = None
    for name, value in _counts(config, EXPERT_COUNT_FIELDS):
        if value is None:
            continue  # a dense model's config may name the field and leave it empty
        value = _check_count(name, value, config_path)
        held = held_experts(shapes) if held is None else held
        if value > held:
            raise ConfigMismatchError(
                f"{config_path}: {name} ({value}) is more than the {held} experts {source} holds: the config "
                "of another model?",
                path=config_path,
                fields={name: (value, held)},
            )
