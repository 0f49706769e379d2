"""Initialising a Hugging Face ``transformers`` model built on ``meta``, by its own rules, alike on any sharding.

transformers initialises nothing on ``meta``, so a ``PreTrainedModel`` built under ``torch.device("meta")``
(say, in a LightningModule's ``configure_model``) holds garbage once sharded and given memory by ``to_empty``,
its non-persistent buffers (RoPE's ``inv_freq``) included. Its ``init_weights()`` takes no seed: it is not our
:class:`~lightning_d9d.plans.SeededInit`, and called on ``DTensor`` shards it would draw each shard on its own.

:func:`init_transformers_model_` does what transformers' ``initialize_weights`` does (each module, children
first, through the ``_init_weights`` of the ``PreTrainedModel`` it belongs to, under transformers' guarded
``torch.nn.init``), but hands each rule full-size fp32 CPU stand-ins of the module's own parameters and buffers,
drawn from the CPU generator seeded by ``(seed, the module's name)`` (:func:`~lightning_d9d.modules.init.
param_seed`), then keeps this rank's shard of them (as :func:`~lightning_d9d.modules.init.init_param_` does).
The values therefore depend on the seed and the names only, not on the mesh, the device or the global RNG
(left untouched). A tied weight (one Parameter in two modules) is written once, by the first module that holds
it: the input embedding, whose value transformers' own tie keeps too.

Nothing here imports transformers: a module is a transformers model only if ``transformers.modeling_utils`` is
already loaded (it must be, for the module to exist).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn

from lightning_d9d.modules.init import assign_full_, param_seed


def is_transformers_model(module: object) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (without importing transformers)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    return isinstance(pretrained, type) and isinstance(module, pretrained)


def _guarded_torch_init() -> contextlib.AbstractContextManager[Any]:
    """transformers' patch of ``torch.nn.init`` for the span of an initialisation (the functions skip tensors
    flagged ``_is_hf_initialized``), as its ``initialize_weights`` runs under; nothing where it has none."""
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if callable(guard) else contextlib.nullcontext()


@torch.no_grad()
def init_transformers_model_(model: nn.Module, seed: int) -> list[str]:
    """Initialise the transformers model ``model`` (sharded or not, its tensors allocated) from ``seed``, by its
    ``_init_weights`` rules; return the names of floating-point tensors that no rule (nor the module's own
    ``reset_parameters``) wrote, left NaN.

    A rule sees only the tensors of the module it is called for in full: one that writes a submodule's
    ``DTensor`` would draw each shard on its own (transformers' rules for its models touch their own).
    """
    written: set[int] = set()
    missed: list[str] = []
    with _guarded_torch_init():
        _visit(model, "", model, seed, written, missed)
    return missed


def _visit(
    module: nn.Module, name: str, owner: nn.Module, seed: int, written: set[int], missed: list[str]
) -> None:
    """transformers' ``smart_apply``: children first, a nested ``PreTrainedModel`` by its own rules."""
    for child_name, child in module.named_children():
        child_owner = child if is_transformers_model(child) else owner
        _visit(child, f"{name}.{child_name}" if name else child_name, child_owner, seed, written, missed)
    _init_module(module, name, owner, seed, written, missed)


def _init_module(
    module: nn.Module, name: str, owner: nn.Module, seed: int, written: set[int], missed: list[str]
) -> None:
    slots: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    for store in stores:
        for key, tensor in store.items():
            if tensor is None:
                continue
            floating = tensor.is_floating_point()
            # NaN shows what no rule writes; an integer buffer no rule writes (a counter) starts at zero, alike
            # on every rank, rather than as whatever the allocation held
            full = (
                torch.full(tuple(tensor.shape), float("nan"), dtype=torch.float32, device="cpu")
                if floating
                else torch.zeros(tuple(tensor.shape), dtype=tensor.dtype, device="cpu")
            )
            stand_in = (
                nn.Parameter(full, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else full
            )
            if id(tensor) in written:  # tied to a tensor an earlier module wrote: the guarded init skips it
                stand_in._is_hf_initialized = True  # type: ignore[attr-defined]
            slots.append((store, key, tensor, stand_in))
    rules: Any = owner._init_weights
    try:
        for store, key, _, stand_in in slots:
            store[key] = stand_in
        _seeded(rules, module, name, seed)
        fresh = [(key, tensor, stand_in) for _, key, tensor, stand_in in slots if id(tensor) not in written]
        unwritten = [
            key for key, _, stand_in in fresh if stand_in.is_floating_point() and stand_in.isnan().any()
        ]
        reset = getattr(module, "reset_parameters", None)
        if unwritten and callable(reset):  # as built eagerly: the module's own init, then transformers' rules
            _seeded(lambda current: (reset(), rules(current)), module, name, seed)
            unwritten = [
                key for key, _, stand_in in fresh if stand_in.is_floating_point() and stand_in.isnan().any()
            ]
        missed.extend(f"{name}.{key}" if name else key for key in unwritten)
        for _, tensor, stand_in in fresh:
            assign_full_(tensor, stand_in.detach())
            written.add(id(tensor))
    finally:
        for store, key, tensor, _ in slots:
            store[key] = tensor


def _seeded(rules: Any, module: nn.Module, name: str, seed: int) -> None:
    """``rules(module)`` with the CPU generator seeded by ``(seed, name)``, its state put back afterwards (the
    stand-ins are CPU tensors: no other generator draws)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(param_seed(seed, name))
        rules(module)
