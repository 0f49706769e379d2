"""Per-block ``torch.compile``: each repeated block compiles once and the graph is reused for all of them."""

from __future__ import annotations

from torch import nn


def apply_compile(blocks: nn.ModuleList | nn.ModuleDict) -> None:
    """Compile every block of ``blocks`` in place (``Module.compile`` keeps parameter names unchanged).

    Blocks share one code object and dynamo inlines ``nn.Module``s (``inline_inbuilt_nn_modules``: on in every
    torch this package supports, deprecated as a setting in 2.13), so the graph is not recompiled per block.
    """
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        block.compile(fullgraph=True)
