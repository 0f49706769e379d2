"""Per-block ``torch.compile``: each repeated block compiles once and the graph is reused for all of them."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(blocks: nn.ModuleList | nn.ModuleDict) -> None:
    """Compile every block of ``blocks`` in place (``Module.compile`` keeps parameter names unchanged)."""
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        block.compile(fullgraph=True)
    # Blocks share one code object; without this, dynamo recompiles per block id.
    torch._dynamo.config.inline_inbuilt_nn_modules = True
