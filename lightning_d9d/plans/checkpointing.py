"""Activation checkpointing of repeated blocks (recompute activations in backward to save memory)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Wrap every block of ``blocks`` in place. Parameter names change by a ``_checkpoint_wrapped_module``
    prefix inside the wrapper; ``torch.distributed.checkpoint`` state dicts strip it again."""
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block, preserve_rng_state=False)
