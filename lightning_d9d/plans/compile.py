"""Per-block ``torch.compile``: each repeated block compiles once and the graph is reused for all of them.

CUDA graphs: ``compile="reduce-overhead"`` (torch's name for it; ``"max-autotune"`` too) compiles each block in
Inductor's mode that records the block's forward and backward as CUDA graphs (``torch/_inductor/
cudagraph_trees.py``) and replays them: one launch per graph instead of one per kernel, which pays where a block's
kernels are short (small widths, short rows). A graph replays the kernels on the addresses it recorded, so
parameters must stay where they were (cudagraph trees treat them as static inputs) and shapes must not depend on
the data. :func:`cudagraph_fallback` decides at plan time where that holds; where it does not, the block compiles
in the same mode without CUDA graphs and one warning says why.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

# torch.compile's modes. "max-autotune-no-cudagraphs" benchmarks Triton GEMM templates against cuBLAS for each
# matmul shape at compile time (minutes, once); "reduce-overhead" and "max-autotune" add CUDA graphs (see
# cudagraph_fallback for where they cannot work).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Each mode that records CUDA graphs and the same mode without them (torch._inductor.list_mode_options:
# "reduce-overhead" is the default options plus triton.cudagraphs; "max-autotune" is "max-autotune-no-cudagraphs"
# plus triton.cudagraphs).
CUDAGRAPH_FALLBACK_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

# Why each configuration cannot keep CUDA graphs, and what the user can change. Read from torch 2.13's source.
FSDP_REASON = (
    "FSDP wraps the blocks (on one rank too, unless fsdp_on_one_rank=False): it frees each block's gathered "
    "parameters after backward and all-gathers them into reallocated storage before the next forward "
    "(FSDPParamGroup.post_backward -> reshard -> free_storage; FSDPParam.init_unsharded_param -> alloc_storage), "
    "and cudagraph trees treat parameters as static inputs: an address that moved fails the replay's check "
    "(CheckInvariantStatus.StaticInputIdxMismatch) and the graph is recorded again, without the "
    "cudagraph_unexpected_rerecord_limit that bounds other re-recordings (CUDAGraphTreeManager._run). On one GPU, "
    "D9DStrategy(fsdp_on_one_rank=False) keeps plain parameters and the graphs"
)
PIPELINE_REASON = (
    "the blocks run in pipeline stages (pp > 1): the schedule runs several micro-batches' forwards before their "
    "backwards and sends activations between ranks, which per-block graphs of cudagraph trees are not proven on "
    "here (and a pipeline spans several ranks, where FSDP wraps the blocks anyway); use pp=1 for CUDA graphs"
)
EXPERT_PARALLEL_REASON = (
    "the blocks hold MoE layers under expert parallelism (ep > 1): the all-to-all's split sizes are token counts "
    "read on the host (.tolist()), a data-dependent shape Inductor does not graph "
    "(get_first_incompatible_cudagraph_node: unbacked symbols); with ep=1 the MoE blocks keep CUDA graphs"
)


def uses_cudagraphs(mode: str | None) -> bool:
    """Whether ``mode`` (a :data:`COMPILE_MODES` name, or ``None`` for no compile) records CUDA graphs."""
    return mode in CUDAGRAPH_FALLBACK_MODES


def cudagraph_fallback(
    mode: str, *, fsdp_sharded: bool, pipelined: bool, expert_parallel: bool
) -> tuple[str, str | None]:
    """The mode the blocks compile in and, where it is not ``mode``, why: a CUDA-graph mode falls back to the
    same mode without CUDA graphs when FSDP wraps the blocks (``fsdp_sharded``), the blocks are pipeline stages
    (``pipelined``) or hold MoE layers whose tokens cross ranks (``expert_parallel``); any other mode is kept,
    with no reason. The first reason that applies is named (FSDP, then pipeline, then ep), so the one the user
    can change on one GPU comes first.

    MoE blocks on one ep rank keep CUDA graphs: routing, permutation and torch's grouped GEMM stay on the device
    with shapes fixed by the batch (``T * top_k`` rows). A part that reads the host there (the ``loop`` grouped
    GEMM: fp32, GPUs without a grouped kernel) is an operator tagged ``cudagraph_unsafe``, which Inductor keeps out
    of the graphs it records by itself (it cuts the graph around it, or records none of it)."""
    fallback = CUDAGRAPH_FALLBACK_MODES.get(mode)
    if fallback is None:
        return mode, None
    reasons = (
        (fsdp_sharded, FSDP_REASON),
        (pipelined, PIPELINE_REASON),
        (expert_parallel, EXPERT_PARALLEL_REASON),
    )
    for applies, reason in reasons:
        if applies:
            return fallback, reason
    return mode, None


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
