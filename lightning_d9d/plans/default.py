"""The plan for modules that bring none: FSDP per repeated block, then the module itself."""

from __future__ import annotations

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans.checkpointing import apply_activation_checkpointing
from lightning_d9d.plans.compile import apply_compile
from lightning_d9d.plans.data_parallel import parallelize_data
from lightning_d9d.plans.options import ParallelOptions


def repeated_blocks(module: nn.Module) -> list[nn.ModuleList]:
    """The outermost ``ModuleList``s of ``module`` (transformer layers, in every model we know)."""
    found: list[nn.ModuleList] = []

    def visit(current: nn.Module) -> None:
        for child in current.children():
            if isinstance(child, nn.ModuleList):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def parallelize_default(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """FSDP/HSDP over the data dims: one unit per element of each repeated block list, then ``module``."""
    unsupported = {name: getattr(dims, name) for name in ("pp", "tp", "cp", "ep") if getattr(dims, name) > 1}
    if unsupported:
        degree, value = next(iter(unsupported.items()))
        raise ValueError(
            f"{type(module).__name__} has no parallelize(dims, options) method, and the default plan only "
            f"does data parallelism: {degree}={value} needs a model plan (see lightning_d9d.models)."
        )
    block_lists = repeated_blocks(module)
    for blocks in block_lists:
        if options.activation_checkpointing:
            apply_activation_checkpointing(blocks)
        if options.compile:
            apply_compile(blocks)
    parallelize_data(module, dims, options, blocks=[block for blocks in block_lists for block in blocks])
