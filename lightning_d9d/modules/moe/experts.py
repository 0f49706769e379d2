"""Experts: all experts' SwiGLU weights stacked, run with grouped GEMMs over tokens grouped by expert.

Layout ``[E, in, out]`` so each projection is ``grouped_mm(x, w, tokens_per_expert)`` with no transpose:
``gate_up_proj [E, hidden, 2 * ffn]`` (every expert's gate columns, then its up columns) and ``down_proj [E, ffn,
hidden]``. Gate and up are one parameter so the forward runs *one* grouped GEMM of width ``2 * ffn`` instead of
two of width ``ffn`` (fewer, fuller tiles; one input-gradient GEMM in backward instead of two plus a sum) on the
weight as it is: two parameters had to be concatenated every forward (an expert-sized copy kept for backward,
whose gradient came back as two strided slices that autograd copied again). transformers' Qwen3-MoE holds
``gate_up_proj [E, 2 * ffn, hidden]`` (gate rows first) and ``down_proj [E, hidden, ffn]``, checkpoints hold one
``[out, in]`` matrix per expert: the Hugging Face mapping transposes, stacks and concatenates
(:mod:`lightning_d9d.state.hf.qwen3_moe`). Expert-tensor parallelism
(:func:`~lightning_d9d.plans.expert_tensor.split_experts_over_tp`) cuts the ffn dimension over tp, gate and up
alike: ``gate_up_proj`` as ``_StridedShard(2, split_factor=2)`` (rank ``r`` holds the ``r``-th ``ffn / tp`` of the
gate columns, then the same of the up columns), ``down_proj`` as ``Shard(1)``; the forward takes the local halves
at whatever width they have, and its down GEMM then gives a partial sum over tp.

Expert parallelism (:func:`~lightning_d9d.plans.parallelize_expert`) shards dimension 0 over ``ep``: each rank
holds ``num_experts / ep`` consecutive experts (``DTensor``s, whose local part :meth:`GroupedExperts.forward`
uses) and receives, from the dispatcher, its tokens grouped by *local* expert; ``tokens_per_expert`` then has
one count per local expert.

LoRA (``LoRA(experts=True)``) hangs per-expert adapters on the experts (``lora``,
:class:`~lightning_d9d.modules.lora.ExpertsLoRA`, the expert on dimension 0 as in the weights): each projection's
output then gains the adapter's update, two narrow grouped GEMMs over the same groups of rows.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels import grouped_mm
from lightning_d9d.kernels.swiglu import weighted_swiglu
from lightning_d9d.modules.lora import ExpertsLoRA, StackedWeight, experts_adapter


@runtime_checkable
class GroupedGemmExperts(Protocol):
    """Experts that run their grouped GEMMs through the registry (:func:`~lightning_d9d.kernels.grouped_mm`) by the
    backend they name (``None``: the registry's choice), contracting and producing ``hidden_size`` and
    ``intermediate_size`` (the expert width) features: :class:`GroupedExperts`, and a ``transformers`` model's
    stacked experts where the adapter runs them (``models/hf/expert.py``). The FP8 plan finds experts by this
    trait (:func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`)."""

    gemm_backend: str | None
    hidden_size: int
    intermediate_size: int


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts: ``down(silu(x @ gate) * (x @ up))`` per expert, over rows grouped by expert.

    ``gemm_backend`` names a grouped GEMM backend (``None``: the registry's choice, see
    :mod:`lightning_d9d.kernels.grouped_gemm`); the FP8 plan sets ``"torchao_fp8"`` on the experts it converts
    (:func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`), which the weights, their sharding and the
    checkpoints never see: only the two grouped GEMMs run in float8."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        gemm_backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gemm_backend = gemm_backend
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, 2 * intermediate_size, device=device)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, device=device))
        self.lora: ExpertsLoRA | None = None  # LoRA's per-expert adapters, where the LoRA plan adds them
        self.reset_parameters()

    def stacked_weights(self) -> dict[str, StackedWeight]:
        """The weights per-expert adapters can adapt, as LoRA sees them (``[E, in, out]``)."""
        return {
            name: StackedWeight.of(self.get_parameter(name), out_first=False)
            for name in ("gate_up_proj", "down_proj")
        }

    def reset_parameters(self) -> None:
        # nn.Linear's default per expert: uniform(+-1/sqrt(fan_in)).
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self, grouped: torch.Tensor, tokens_per_expert: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``grouped [N, hidden]`` rows sorted by expert, ``tokens_per_expert [E]`` -> ``[N, hidden]``; with
        ``row_weights [N]`` (each row's routing weight) every row's output is weighed by it (applied to the
        activation before the down projection, where it is narrow: see :mod:`lightning_d9d.modules.moe.dispatch`)."""
        gate_up_proj, down_proj = _local(self.gate_up_proj), _local(self.down_proj)
        adapter = experts_adapter(self)
        gate_up = grouped_mm(grouped, gate_up_proj, tokens_per_expert, backend=self.gemm_backend)
        if adapter is not None:
            gate_up = gate_up + adapter.update("gate_up_proj", grouped, tokens_per_expert)
        gate, up = gate_up.chunk(2, dim=-1)  # this rank's ffn / tp of each under expert-tensor parallelism
        hidden = weighted_swiglu(gate, up, row_weights)
        output = grouped_mm(hidden, down_proj, tokens_per_expert, backend=self.gemm_backend)
        if adapter is not None:
            output = output + adapter.update("down_proj", hidden, tokens_per_expert)
        return output

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, gemm_backend={self.gemm_backend}"
        )


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism the weights are ``DTensor``s split over ``ep`` on dim 0
    (FSDP has gathered its own dim by now) and the kernels take plain tensors; the gradient flows back into the
    ``DTensor`` with the same layout."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
