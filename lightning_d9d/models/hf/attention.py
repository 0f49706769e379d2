"""Causal attention for a ``transformers`` model without the mask machinery's host sync.

Called without an ``attention_mask`` and without a cache (a pretraining batch), a ``transformers`` decoder
still runs its mask preparation (``masking_utils.create_causal_mask``): it checks the ``position_ids`` it built
itself for packed sequences (``find_packed_sequence_indices``), and that check reads a GPU value on the host in
every forward. The CPU then waits for the GPU at the start of each step, and what it queues next (FSDP's hooks,
the compiled layers' launches) is no longer hidden behind GPU work: the step time varies from step to step
(``docs/benchmarks.md``, session 12). The mask it would build is none anyway: for SDPA a plain causal mask is
skipped in favour of ``is_causal``.

``transformers`` skips the whole preparation for an attention implementation that has no mask function of its
own (its rule for external backends). :func:`causal_attention_without_mask_sync` registers ``transformers``' own
SDPA attention under :data:`CAUSAL_ATTENTION_NAME`, in the attention interface only, and a forward pre-hook on
the base model points the model's configs at it for a forward that passes no ``attention_mask``, no cache
(``past_key_values``, or ``cache`` as transformers 5.25 names it) and no packed ``position_ids`` of its own, and
back at ``"sdpa"`` for any other forward (padding masks, packed documents and generation keep the model's own
masks). The attention computed is the same call: SDPA with ``is_causal=True``.

Only for models whose every config asks for ``"sdpa"`` and whose layers are all full attention (a sliding window
needs its mask). Under context parallelism the adapter registers its own attention instead (:mod:`.context`).

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from torch import nn

CAUSAL_ATTENTION_NAME = "lightning_d9d_causal"
SDPA = "sdpa"
# A forward given any of these keeps the model's own masks; "cache" is transformers' name for past_key_values
# from 5.25 (a chunk of several new tokens after a cache needs the mask: SDPA's is_causal aligns top-left).
NOT_PLAIN = ("attention_mask", "past_key_values", "cache", "position_ids")


def causal_attention_without_mask_sync(model: nn.Module) -> bool:
    """Install the switch described in the module docstring on ``model`` (a ``transformers`` model or a pipeline
    stage of one); False, changing nothing, where it does not apply."""
    configs = _configs(model)
    if not configs or not all(_plain_causal(config) for config in configs):
        return False
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    registered = getattr(interface, "_global_mapping", None)
    if interface is None or not isinstance(registered, dict) or SDPA not in registered:
        return False
    interface.register(CAUSAL_ATTENTION_NAME, registered[SDPA])
    base = getattr(model, "base_model", None)
    base = base if isinstance(base, nn.Module) else model
    base.register_forward_pre_hook(_CausalSwitch(base, configs), with_kwargs=True)
    return True


def _configs(model: nn.Module) -> list[Any]:
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(type(config), "_attn_implementation"):
            found[id(config)] = config
    return list(found.values())


def _plain_causal(config: Any) -> bool:
    if config._attn_implementation not in (SDPA, CAUSAL_ATTENTION_NAME):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    # no layer_types: a sliding window, where the config has one and uses it, needs its mask
    return (
        getattr(config, "sliding_window", None) is None
        or getattr(config, "use_sliding_window", True) is False
    )


class _CausalSwitch:
    """The base model's forward pre-hook: the configs at :data:`CAUSAL_ATTENTION_NAME` for a plain causal
    forward, at ``"sdpa"`` otherwise."""

    def __init__(self, base: nn.Module, configs: list[Any]) -> None:
        self.configs = configs
        parameters = inspect.signature(base.forward).parameters.values()
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.index = {name: i for i, name in enumerate(names)}

    def _given(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        i = self.index.get(name)
        value = args[i] if i is not None and i < len(args) else kwargs.get(name)
        return value is not None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        plain = not any(self._given(name, args, kwargs) for name in NOT_PLAIN)
        implementation = CAUSAL_ATTENTION_NAME if plain else SDPA
        for config in self.configs:
            if config._attn_implementation != implementation:
                config._attn_implementation = implementation
