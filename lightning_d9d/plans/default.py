"""The plan for modules that bring none: FSDP per repeated block, then the module itself."""

from __future__ import annotations

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans.blocks import parallelize_blocks
from lightning_d9d.plans.degrees import DATA_PARALLEL, FEATURES, require_degrees
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


def parallelize_default(
    module: nn.Module, dims: ParallelDims, options: ParallelOptions, *, pipeline_stage: bool = False
) -> None:
    """FSDP/HSDP over the data dims: one unit per element of each repeated block list, then ``module``.

    Refuses every other degree. pp is refused too, unless ``module`` is a pipeline stage that the strategy
    carved (``pipeline_stage=True``): a stage is data-parallel within its pp rank like any module. Random ops
    in user blocks (dropout) are kept exact under activation checkpointing: the RNG state is preserved.
    """
    name = type(module).__name__
    require_degrees(
        dims,
        supported=(*DATA_PARALLEL, "pp") if pipeline_stage else DATA_PARALLEL,
        owner=f"the default plan for {name} (data parallelism only)",
        alternatives=dict.fromkeys(
            FEATURES, f"give {name} a parallelize(dims, options) method (see lightning_d9d.models)"
        ),
    )
    parallelize_blocks(module, repeated_blocks(module), dims, options)
