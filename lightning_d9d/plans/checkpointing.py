"""Activation checkpointing of repeated blocks (recompute activations in backward to save memory)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(blocks: nn.ModuleList | nn.ModuleDict) -> None:
    """Wrap every block of ``blocks`` in place. Parameter names gain a ``_checkpoint_wrapped_module``
    segment inside the wrapper; ``torch.distributed.checkpoint`` state dicts strip it again."""
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=False)  # type: ignore[index]
