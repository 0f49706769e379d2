"""The part of every model's plan that follows TP/CP/EP: activation checkpointing, compile, data parallelism; and
the float8 conversion that precedes TP (``convert_blocks_to_float8``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe import MoE
from lightning_d9d.plans.checkpointing import apply_activation_checkpointing, checkpointing_kind
from lightning_d9d.plans.compile import apply_compile, compile_mode, cudagraph_fallback
from lightning_d9d.plans.data_parallel import parallelize_data, wraps_in_fsdp
from lightning_d9d.plans.fp8 import apply_fp8, convert_experts_to_float8
from lightning_d9d.plans.options import ParallelOptions

log = logging.getLogger("lightning_d9d.plans")

BlockList = nn.ModuleList | nn.ModuleDict


def convert_blocks_to_float8(
    block_lists: Sequence[BlockList], dims: ParallelDims, options: ParallelOptions
) -> None:
    """The float8 linears ``options.fp8`` asks for (:mod:`lightning_d9d.plans.fp8`), in every block of
    ``block_lists``, and the grouped experts' float8 GEMMs as ``options.fp8_experts`` asks. A model's plan calls
    it before its tp plan, which then gives the converted linears torchao's float8 styles; ``parallelize_blocks``
    calls it again, converting only what is left."""
    if options.fp8 is None:
        return
    # float8 all-gathers pay where FSDP gathers shards; on one rank they only add a cast per block (measured:
    # tensorwise at 0.54x bf16 on the 0.6B shape on an H200 with them)
    every_block = [block for blocks in block_lists for block in _blocks_of(blocks)]
    apply_fp8(every_block, options.fp8, dims, module_filter=options.fp8_filter, fsdp=dims.fsdp > 1)
    convert_experts_to_float8(
        every_block, options.fp8, options.fp8_experts, device_type=_device_type(dims, every_block)
    )


def _device_type(dims: ParallelDims, blocks: Sequence[nn.Module]) -> str:
    """Where the blocks will run: the mesh's device type, else their parameters' (not meta), else ``"cpu"``
    (which keeps the experts in bf16: never a float8 kernel on a device not known to take it)."""
    if dims.mesh is not None:
        return dims.mesh.device_type
    devices = {p.device.type for block in blocks for p in block.parameters()} - {"meta"}
    return devices.pop() if len(devices) == 1 else "cpu"


def parallelize_blocks(
    module: nn.Module,
    block_lists: Sequence[BlockList],
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    preserve_rng_state: bool = True,
    moe: bool | None = None,
) -> None:
    """Checkpoint and compile each block of ``block_lists`` (as ``options`` ask), then apply data parallelism:
    one FSDP unit per block, then ``module`` for the rest.

    The order is torchtitan's and matters: a model applies its TP/CP/EP plans before calling this (they
    rewrite the blocks' layers); checkpointing wraps a block before compile, so one compiled graph covers
    forward and recompute (except full recompute under tp, which wraps the compiled block: see below); FSDP
    goes last, around the wrapped and compiled blocks.

    ``preserve_rng_state=False`` skips saving and restoring the RNG state around each recompute. Only a model
    whose blocks draw no random numbers (no dropout) may pass it; otherwise recompute draws other dropout
    masks than forward did and the gradients are silently wrong.

    A compile mode with CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``) is kept only where the graphs can
    replay: no FSDP around the blocks, no pipeline, no MoE layers under expert parallelism (``moe``: whether the
    blocks hold any; ``None`` looks for this package's :class:`~lightning_d9d.modules.moe.MoE`). Elsewhere the
    blocks compile in the same mode without CUDA graphs, and one warning names the reason (:func:`~lightning_d9d.
    plans.compile.cudagraph_fallback`).
    """
    # swaps modules: before checkpointing wraps and compile traces them (a no-op where the plan converted first)
    convert_blocks_to_float8(block_lists, dims, options)
    kind = checkpointing_kind(options.activation_checkpointing)
    mode = compile_mode(options.compile)
    if mode is not None:
        if moe is None:
            moe = any(isinstance(m, MoE) for blocks in block_lists for m in blocks.modules())
        mode, reason = cudagraph_fallback(
            mode,
            fsdp_sharded=wraps_in_fsdp(dims, options),
            pipelined=dims.pp_enabled,
            expert_parallel=moe and dims.ep_enabled,
        )
        if reason is not None:
            log.warning(
                "compile=%r: the blocks compile in mode %r, without CUDA graphs: %s.",
                options.compile,
                mode,
                reason,
            )
    # Inside one compiled graph, full recompute of tensor-parallel blocks fails in AOTAutograd on torch 2.13
    # ("expected all tensors_saved_with_vc_check to be Tensors": the DTensors' DeviceMesh, now a graph input, is
    # kept for the recompute). Checkpointing around the compiled block instead re-runs the compiled forward in
    # backward, the same recompute.
    compile_first = kind == "full" and dims.tp_enabled
    for blocks in block_lists:
        if mode is not None and compile_first:
            apply_compile(blocks, mode)
        if kind is not None:
            apply_activation_checkpointing(blocks, preserve_rng_state=preserve_rng_state, kind=kind)
        if mode is not None and not compile_first:
            apply_compile(blocks, mode)
    # Read the blocks after wrapping: the FSDP units are the checkpoint wrappers, not the modules inside.
    units = [block for blocks in block_lists for block in _blocks_of(blocks)]
    parallelize_data(module, dims, options, blocks=units)


def _blocks_of(blocks: BlockList) -> list[nn.Module]:
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
