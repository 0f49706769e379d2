"""Activation checkpointing of repeated blocks (recompute activations in backward to save memory)."""

from __future__ import annotations

from torch import nn

from lightning_d9d.compat import checkpoint_wrapper


def apply_activation_checkpointing(
    blocks: nn.ModuleList | nn.ModuleDict, *, preserve_rng_state: bool = True
) -> None:
    """Wrap every block of ``blocks`` in place. Parameter names gain a ``_checkpoint_wrapped_module``
    segment inside the wrapper; ``torch.distributed.checkpoint`` state dicts strip it again.

    ``preserve_rng_state`` restores the RNG state before each recompute, so dropout draws the same masks as in
    forward. Turn it off (it costs a state save and restore per block) only for blocks without random ops.
    """
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=preserve_rng_state)  # type: ignore[index]
