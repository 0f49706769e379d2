"""Per-block ``torch.compile``: each repeated block compiles once and the graph is reused for all of them."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

# torch.compile's modes. "max-autotune-no-cudagraphs" benchmarks Triton GEMM templates against cuBLAS for each
# matmul shape at compile time (minutes, once); the cudagraph modes need static inputs and addresses, which
# FSDP's per-block all-gathers do not give.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(compile: bool | str) -> str | None:
    """The ``torch.compile`` mode that ``compile`` asks for: ``None`` for ``False``, ``"default"`` for
    ``True``, a mode name as given; anything else is refused, naming the choices."""
    if compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(
        f"compile={compile!r}: use True, False or one of torch.compile's modes {', '.join(map(repr, COMPILE_MODES))}"
    )


def apply_compile(blocks: nn.ModuleList | nn.ModuleDict, mode: str = "default") -> None:
    """Compile every block of ``blocks`` in place (``Module.compile`` keeps parameter names unchanged).

    Blocks share one code object and dynamo inlines ``nn.Module``s (``inline_inbuilt_nn_modules``: on in every
    torch this package supports, deprecated as a setting in 2.13), so the graph is not recompiled per block.
    A block is one graph (``fullgraph=True``) unless it holds FSDP units of its own (an MoE block's experts
    under ep, the MoE block under tp): FSDP's hooks are hidden from dynamo, so the graph breaks around them.
    """
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        block.compile(fullgraph=not holds_fsdp_units(block), mode=mode)


def holds_fsdp_units(block: nn.Module) -> bool:
    """Whether a submodule of ``block`` (not ``block`` itself) is already an FSDP unit."""
    return any(isinstance(module, FSDPModule) for name, module in block.named_modules() if name)
