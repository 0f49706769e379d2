"""Options every plan may read, chosen by the strategy (from the Trainer's precision and its own arguments)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_d9d.plans.lora import LoRA


@dataclass(frozen=True)
class ParallelOptions:
    """How to parallelize, beyond the degrees in :class:`~lightning_d9d.mesh.ParallelDims`.

    Args:
        mp_policy: FSDP2 mixed precision (``bf16-mixed``: bf16 params, fp32 gradient reduction); ``None`` keeps
            the parameters' own dtype for compute and communication.
        reshard_after_forward: free the unsharded parameters after forward (ZeRO-3) or keep them until
            backward (ZeRO-2, more memory, fewer all-gathers). ``None`` (the default): free them where they
            are sharded, keep them where nothing is (one rank, or ``dp_shard=1`` under replication). There
            FSDP2 still gathers into a buffer of its own (under ``bf16-mixed``, the bf16 cast): ``True`` frees
            that copy of the blocks' weights from forward to backward for one more cast per block in backward
            (on one H100: 3.3 GiB less at Qwen3-4B's layer x 18 for a 1.7 % slower step, 0.8 GiB for 2 % at
            0.6B; ``docs/benchmarks.md``, run U14). The experts of an MoE free theirs unless it is
            ``False``.
        activation_checkpointing: recompute each repeated block's activations in backward: ``True`` (or
            ``"full"``) the whole block, ``"selective"`` only its element-wise ops (matmul and attention
            outputs kept); ``False`` keeps everything.
        compile: ``torch.compile`` each repeated block: ``True`` in torch's default mode, or a mode's name
            (``"max-autotune-no-cudagraphs"``: GEMM templates tuned per shape at compile time;
            ``"reduce-overhead"``: CUDA graphs, where nothing stands in their way, see
            :func:`~lightning_d9d.plans.compile.cudagraph_fallback`).
        context_attention: the context-parallel attention path when cp > 1: ``"auto"`` (torch's ring kernels on
            CUDA, the portable all-gather path elsewhere), ``"all_gather"``, ``"torch_ring"`` (CUDA only) or
            ``"heads"``: head-parallel (Ulysses), two all-to-alls per layer around the model's own attention over
            the whole sequence for ``heads / cp`` heads; cp must divide each tp rank's query heads.
        fsdp_on_one_rank: wrap the model in FSDP2 also when the whole world is one rank (parameters are then
            ``DTensor``s as on every other layout). ``False`` leaves plain parameters there: no all-gather
            copies, casts or hooks around each block (the mixed precision then comes from autocast).
        fp8: train the blocks' linear layers in float8 through torchao: ``"tensorwise"`` or ``"rowwise"``
            (:mod:`lightning_d9d.plans.fp8`); ``None`` (default) keeps them as they are.
        fp8_filter: ``(module, name_in_block) -> bool``, which linear layers ``fp8`` converts (default:
            :func:`~lightning_d9d.plans.fp8.fp8_linear_filter`).
        fp8_experts: with ``fp8`` on, the grouped experts' GEMMs in float8 rowwise through torchao
            (:func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`): ``False`` (default: at our MoE
            shape, experts of width 384, turning it on made the step 1.57x slower on an H100) keeps the experts
            in bf16; ``None`` where the device allows it (CUDA, compute capability 9.0+, torchao's MoE package),
            bf16 elsewhere with one log line; ``True`` requires it (refused where it cannot run).
        async_tp: torch's micro-pipelined tensor parallelism (Inductor's pass over the compiled blocks,
            :mod:`lightning_d9d.plans.async_tp`). The strategy switches it on for the tp group once the mesh
            exists, before the blocks compile; no plan reads it.
        lora: low-rank adapters on the layers it names, every other parameter frozen
            (:class:`~lightning_d9d.plans.lora.LoRA`); applied before every other plan. ``None``: off.
        expert_tensor_parallel: under tp > 1, split every MoE expert over the tp ranks (gate and up
            column-wise, down row-wise: :mod:`lightning_d9d.plans.expert_tensor`), the tp group's routed tokens
            gathered before the experts and their outputs reduce-scattered after; ``False`` (default) keeps the
            experts whole on every tp rank, each rank routing its own tokens.
    """

    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool | None = None
    activation_checkpointing: bool | str = False
    compile: bool | str = False
    context_attention: str = "auto"
    fsdp_on_one_rank: bool = True
    fp8: str | None = None
    fp8_filter: Callable[[nn.Module, str], bool] | None = None
    fp8_experts: bool | None = False
    async_tp: bool = False
    lora: LoRA | None = None
    expert_tensor_parallel: bool = False

    def reshards(self, shard_ranks: int) -> bool:
        """Whether an FSDP unit whose parameters are sharded over ``shard_ranks`` ranks frees its gathered
        parameters after forward (``reshard_after_forward``, its default resolved)."""
        if self.reshard_after_forward is None:
            return shard_ranks > 1
        return self.reshard_after_forward
