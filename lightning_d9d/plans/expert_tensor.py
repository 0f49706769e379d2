"""Expert-tensor parallelism (``expert_tensor_parallel=True``): each MoE expert split over the tp ranks.

Under tp > 1 an MoE block keeps its experts whole on every tp rank by default: each tp rank routes its own
sequence shard through them (:mod:`lightning_d9d.plans.routing`), so the experts, most of an MoE's weights, are
held tp times. With expert-tensor parallelism (Megatron's ETP, at the tp degree) every tp rank holds ``1/tp`` of
every expert instead:

- each expert's gate and up projections are split column-wise and its down projection row-wise over the tp mesh,
  as ``DTensor`` placements: the fused gate/up weight as ``_StridedShard(dim, split_factor=2)`` (rank ``r`` holds
  the ``r``-th ``ffn / tp`` of the gate, then the same of the up: its SwiGLU is local), the down weight as
  ``Shard(dim)``. FSDP, checkpoints (:mod:`lightning_d9d.state.boxes` writes the strided shard as its two
  boxes) and the Hugging Face export see whole experts, in any layout;
- the block's dispatcher is wrapped in :class:`~lightning_d9d.modules.moe.ExpertTensorParallelDispatcher`: the
  routed tokens of the tp group are all-gathered before the experts and the partial outputs reduce-scattered
  after them;
- the experts become their own FSDP unit over the data ranks (``fsdp``, or ``hsdp`` under HSDP), whose gradients
  are divided as a dense tp-sharded weight's are: every tp rank's shard saw every token of its tp group, so its
  gradient is whole (nothing to sum over tp). The router and shared experts stay whole, run on this rank's tokens,
  and the routing plan sums their gradients over tp as without the split.

Refused when the strategy is built, before any process group (:func:`check_expert_tensor_parallel`): tp = 1
(nothing to split), ep > 1 (the expert mesh carves ep across tp, so an ep group would be tp peers holding shards of
the same experts), ``LoRA(experts=True)`` (the per-expert adapters are not split) and float8 experts (not proven
on shards yet). An expert width tp does not divide is refused on every rank alike when the plan reaches the experts
(by the ``transformers`` adapter's checks before any collective).

Call :func:`split_experts_over_tp` after the tp plan and before :func:`~lightning_d9d.plans.route_on_sequence_shards`
(whose FSDP unit then leaves the experts to their own).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Placement, Shard, distribute_tensor

from lightning_d9d.compat import strided_shard_type
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe import ExpertTensorParallelDispatcher, MoE
from lightning_d9d.plans.data_parallel import data_parallel_mesh
from lightning_d9d.plans.options import ParallelOptions

OPTION = "expert_tensor_parallel"


def check_expert_tensor_parallel(
    enabled: bool,
    *,
    tp: int,
    ep: int,
    lora_experts: bool,
    fp8: str | None,
    fp8_experts: bool | None,
    owner: str,
) -> bool:
    """The option as given, refused where it cannot apply (before any process group): see the module docstring."""
    if not isinstance(enabled, bool):
        raise TypeError(f"{owner}({OPTION}=...) takes True or False, got {enabled!r}")
    if not enabled:
        return False
    if tp == 1:
        raise ValueError(
            f"{owner}({OPTION}=True, tp=1): expert-tensor parallelism splits each expert over the tp ranks; "
            "set tp > 1, or leave expert_tensor_parallel=False (ep splits the experts over ranks instead)"
        )
    if ep > 1:
        raise NotImplementedError(
            f"{owner}({OPTION}=True, tp={tp}, ep={ep}): experts split over ep and tp at once are not implemented "
            f"yet (the expert mesh carves ep across tp); use ep={ep} with expert_tensor_parallel=False (each tp "
            "rank routes its own tokens to whole experts split over ep), or expert_tensor_parallel=True with ep=1"
        )
    if lora_experts:
        raise NotImplementedError(
            f"{owner}({OPTION}=True, lora=LoRA(experts=True)): the experts' adapters are not split over tp; adapt "
            "the experts without expert_tensor_parallel, or use LoRA(experts=False)"
        )
    if fp8 is not None and fp8_experts is not False:
        raise NotImplementedError(
            f"{owner}({OPTION}=True, fp8_experts={fp8_experts!r}): the float8 grouped GEMM on expert shards is not "
            "proven yet; keep fp8_experts=False (the experts' GEMMs in bf16) or expert_tensor_parallel=False"
        )
    return True


def check_expert_width(width: int, tp: int, owner: str) -> None:
    """tp must divide each expert's width (its gate, up and down are split over tp by it)."""
    if width % tp:
        raise ValueError(
            f"{owner}: tp ({tp}) must divide the experts' width ({width}) under expert_tensor_parallel=True: each "
            f"tp rank holds width / tp of every expert; choose a tp among the divisors of {width}, or "
            "expert_tensor_parallel=False"
        )


def split_experts_over_tp(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> list[MoE]:
    """Split every :class:`~lightning_d9d.modules.moe.MoE` block's experts in ``module`` over tp (see the module
    docstring); returns the blocks changed. Nothing without ``options.expert_tensor_parallel`` or tp."""
    if not (options.expert_tensor_parallel and dims.tp_enabled):
        return []
    blocks = [child for child in module.modules() if isinstance(child, MoE)]
    for block in blocks:
        check_expert_width(block.experts.intermediate_size, dims.tp, type(module).__name__)
    tp = dims.mesh_for("tp")
    for block in blocks:
        # ours: gate_up_proj [E, hidden, 2 * ffn] (gate columns, then up), down_proj [E, ffn, hidden]
        shard_experts_over_tp(
            block.experts,
            {"gate_up_proj": fused_columns(2), "down_proj": Shard(1)},
            dims,
            options,
        )
        block.dispatcher = ExpertTensorParallelDispatcher(block.dispatcher, tp)
    return blocks


def fused_columns(dim: int) -> Placement:
    """The placement of a fused gate/up weight split column-wise over tp (gate and up of equal width on ``dim``,
    gate first): each rank holds its ``1/tp`` of the gate followed by the same ``1/tp`` of the up."""
    placement: Placement = strided_shard_type()(dim, split_factor=2)
    return placement


def shard_experts_over_tp(
    experts: nn.Module, placements: Mapping[str, Placement], dims: ParallelDims, options: ParallelOptions
) -> None:
    """``experts``' parameters named in ``placements`` sharded over tp as named there (every tp rank holds the
    whole weights: no collective), then ``experts`` made its own FSDP unit over the data ranks. A parameter of
    ``experts`` not named is refused (its gradient would cover this rank's part only)."""
    own = {name for name, _ in experts.named_parameters()}
    if own != set(placements):
        raise NotImplementedError(
            f"{type(experts).__name__} holds {sorted(own)}; expert_tensor_parallel splits {sorted(placements)} "
            "only. Use expert_tensor_parallel=False"
        )
    tp = dims.mesh_for("tp")
    for name, placement in placements.items():
        weight = experts.get_parameter(name)
        sharded = distribute_tensor(weight.data, tp, [placement], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    _own_data_parallel_unit(experts, data_parallel_mesh(dims), options)


def _own_data_parallel_unit(experts: nn.Module, mesh: DeviceMesh, options: ParallelOptions) -> None:
    fully_shard(
        experts,
        mesh=mesh,
        mp_policy=options.mp_policy or MixedPrecisionPolicy(),
        # most of an MoE's weights: the gathered copies are freed after forward unless asked otherwise (as ep's)
        reshard_after_forward=options.reshard_after_forward is not False,
    )
