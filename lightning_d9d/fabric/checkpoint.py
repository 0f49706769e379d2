"""``fabric.save`` / ``fabric.load`` in the training checkpoint format of the Trainer (``state/training.py``).

A Fabric state is a dict of named objects: ``{"model": model, "optimizer": optimizer, "step": 12, ...}``. It maps
onto the Trainer's checkpoint as follows: the one model is the ``state_dict`` section, the optimizers (in the
state's order) are ``optimizer_0``, ``optimizer_1``, ...; everything else goes to ``meta.pt`` (objects with a
``state_dict()`` as their state), with the names recorded under ``FABRIC_NAMES`` so that a load can say which
name it expected. So the same guarantees hold: atomic, checksummed, every file checked before the model is
touched, ``meta.pt`` read with ``weights_only`` (plain values and tensors only: a checkpoint is untrusted input),
any layout resumable on any other (DCP reshards), every rank's random states put back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer

from lightning_d9d.state import training as training_checkpoint
from lightning_d9d.state.rng import RNG_KEY
from lightning_d9d.strategies.hf_record import with_hf_config

FABRIC_NAMES = "fabric_names"  # in meta.pt: {"model": name, "optimizers": [names]}


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint saves as its ``state_dict()`` and restores in place (a scheduler), as Fabric tells it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class SplitState:
    """A Fabric state dict taken apart: the model, the optimizers and the rest, each with its name."""

    model_name: str
    model: nn.Module
    optimizers: dict[str, Optimizer]
    rest: dict[str, Any]


def split_state(state: Mapping[str, Any], *, action: str) -> SplitState:
    """``state``'s one model, its optimizers (in order) and the other entries; ``action`` ("save" / "load")
    names the call in errors."""
    models = {name: obj for name, obj in state.items() if isinstance(obj, nn.Module)}
    if len(models) != 1:
        found = f"{len(models)} ({', '.join(models)})" if models else "none"
        raise ValueError(
            f"fabric.{action}(path, state) under the d9d strategy needs exactly one model in the state, found "
            f"{found}: pass it like {{'model': model, 'optimizer': optimizer, ...}}; for several models, call "
            f"fabric.{action} once per model with its own path"
        )
    ((model_name, model),) = models.items()
    optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
    rest = {name: obj for name, obj in state.items() if name not in models and name not in optimizers}
    return SplitState(model_name, model, optimizers, rest)


def to_checkpoint(state: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer-format checkpoint dict of a Fabric ``state`` (see the module docstring)."""
    split = split_state(state, action="save")
    checkpoint: dict[str, Any] = {
        training_checkpoint.MODEL_SECTION: get_model_state_dict(split.model),
        "optimizer_states": [
            training_checkpoint.optimizer_state(split.model, optimizer)
            for optimizer in split.optimizers.values()
        ],
        FABRIC_NAMES: {"model": split.model_name, "optimizers": list(split.optimizers)},
    }
    for name, obj in split.rest.items():
        checkpoint[name] = obj.state_dict() if isinstance(obj, Stateful) else obj
    # the model's Hugging Face config, when it has one: `convert dcp-to-hf` then needs no --config
    return with_hf_config(checkpoint, split.model)


def load_into(
    path: Path,
    state: Mapping[str, Any],
    *,
    strict: bool,
    weights_only: bool | None,
    frozen: Mapping[str, tuple[float, float, int]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the checkpoint at ``path`` into ``state``'s model and optimizers (in place) and return ``(values,
    remainder)``: the new values of ``state``'s other entries (objects with ``load_state_dict`` are loaded in
    place and not among them) and what the checkpoint holds beyond them. ``strict``: every entry of ``state``
    must be in the checkpoint, and the model's keys must match. The names are checked with the files, before
    the model is touched. ``frozen``: the model's frozen base fingerprint, for a LoRA checkpoint that left the base
    out (``training.load``)."""
    split = split_state(state, action="load")
    optimizers = dict(enumerate(split.optimizers.values()))
    meta = training_checkpoint.load(
        path,
        split.model,
        optimizers,
        strict=strict,
        weights_only=weights_only,
        check=lambda meta: _check_names(path, meta, split, strict=strict),
        frozen=frozen,
    )
    meta.pop(FABRIC_NAMES, None)
    values: dict[str, Any] = {}
    for name, obj in split.rest.items():
        if name not in meta:
            continue
        if isinstance(obj, Stateful):
            obj.load_state_dict(meta.pop(name))
        else:
            values[name] = meta.pop(name)
    return values, meta


def _check_names(path: Path, meta: Mapping[str, Any], split: SplitState, *, strict: bool) -> None:
    """The optimizers are passed under the names, and in the order, they were saved with; with ``strict``, every
    other entry of the state is in the checkpoint."""
    names = meta.get(FABRIC_NAMES)
    # read from the file: used only if it is the list of names this module writes
    saved = names.get("optimizers") if isinstance(names, dict) else None
    saved_optimizers = [str(n) for n in saved] if isinstance(saved, list) else None
    if saved_optimizers is not None and saved_optimizers[: len(split.optimizers)] != list(split.optimizers):
        raise KeyError(
            f"{path} holds the optimizers {saved_optimizers} in this order, the state passed to fabric.load "
            f"names {list(split.optimizers)}: pass the optimizers under the names (and in the order) they were "
            "saved with"
        )
    held = set(meta) - {FABRIC_NAMES, RNG_KEY}
    missing = [name for name in split.rest if name not in held]
    if strict and missing:
        raise KeyError(
            f"{path} holds no entry {missing[0]!r} of the state passed to fabric.load (it holds "
            f"{sorted(held)}); pass strict=False to load the rest"
        )
