"""The stacked-experts layouts the adapter's experts forward runs (:mod:`.expert`): which parameters an experts
module holds, in which shapes, and what one expert computes on the rows the dispatcher grouped for it.

- :data:`STACKED`, ``transformers``' usual layout (Qwen3-MoE, Mixtral, ...): ``gate_up_proj [E, 2 * ffn, hidden]``
  with the gate rows first, ``down_proj [E, hidden, ffn]``, no biases, the module's ``act_fn``:
  ``down(act_fn(gate) * up)``.
- :data:`GPT_OSS`, GPT-OSS's: the weights transposed (``gate_up_proj [E, hidden, 2 * ffn]``, ``down_proj [E, ffn,
  hidden]``), a bias per expert beside each (``gate_up_proj_bias [E, 2 * ffn]``, ``down_proj_bias [E, hidden]``),
  gate and up interleaved (columns ``0, 2, 4, ...`` the gate, ``1, 3, 5, ...`` the up) and the clamped SwiGLU with
  a sigmoid gain (:func:`clamped_swiglu`, the module's ``alpha`` and ``limit``).

A layout is read off the parameters' names and shapes; whether the class's own forward computes what the layout
does is for :mod:`.expert`'s probe to say, on the random weights :meth:`ExpertsLayout.probe_weights` draws. Every
parameter holds the expert on dimension 0, so ep splits biases with their weights alike.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels import weigh_rows
from lightning_d9d.modules.lora import ExpertsLoRA, experts_adapter

GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertsLayout(ABC):
    """One stacked-experts layout: its parameter names, its forward's arguments, its shapes and its math."""

    #: the experts module's own parameters, in this order
    weights: tuple[str, ...]
    #: the class's forward's first arguments (after ``self``)
    arguments: tuple[str, ...]
    #: what one expert computes, for a refusal
    math: str

    @abstractmethod
    def problem(self, experts: nn.Module) -> str | None:
        """Why ``experts`` (holding exactly :attr:`weights`) is not in this layout (``None``: it is)."""

    @abstractmethod
    def probe_weights(
        self, experts: nn.Module, num_experts: int, hidden: int, ffn: int
    ) -> dict[str, torch.Tensor]:
        """Random weights of this layout for a probe of the class's forward (drawn from the global generator,
        which the caller seeds), of a size that makes every step of the math matter."""

    @abstractmethod
    def run(
        self,
        experts: nn.Module,
        rows: torch.Tensor,
        counts: torch.Tensor,
        row_weights: torch.Tensor,
        matmul: GroupedMatmul,
    ) -> torch.Tensor:
        """``rows [N, hidden]`` grouped by this rank's experts (``counts`` per expert) -> each row's expert output
        times its routing weight (``row_weights [N]``), ``[N, hidden]``: what the dispatcher's combine sums."""


class StackedLayout(ExpertsLayout):
    """``transformers``' usual stacked experts (see the module docstring). The routing weight multiplies the
    activation before the down projection (``down(w * h) = w * down(h)``: see :mod:`~lightning_d9d.modules.moe.
    dispatch` for why), and LoRA's per-expert adapters add their updates to each projection."""

    weights = ("gate_up_proj", "down_proj")
    arguments = ("hidden_states", "top_k_index", "top_k_weights")
    math = "act_fn(gate) * up on gate_up_proj's halves, weighted, through down_proj"

    def problem(self, experts: nn.Module) -> str | None:
        act_fn = getattr(experts, "act_fn", None)
        others = [
            child
            for child in experts.children()
            if child is not act_fn and not isinstance(child, ExpertsLoRA)
        ]
        if others:
            return f"holds submodules {[type(child).__name__ for child in others]} beside its stacked weights"
        if not callable(act_fn):
            return f"has act_fn={act_fn!r}; the adapter's forward applies the module's act_fn"
        gate_up_proj, down_proj = (experts.get_parameter(name) for name in self.weights)
        experts_count, double_ffn, hidden = gate_up_proj.shape
        if down_proj.shape != (experts_count, hidden, double_ffn // 2):
            return (
                f"has gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)}, not "
                "transformers' [E, 2 * ffn, hidden] / [E, hidden, ffn]"
            )
        return None

    def probe_weights(
        self, experts: nn.Module, num_experts: int, hidden: int, ffn: int
    ) -> dict[str, torch.Tensor]:
        return {
            "gate_up_proj": torch.randn(num_experts, 2 * ffn, hidden) / hidden**0.5,
            "down_proj": torch.randn(num_experts, hidden, ffn) / ffn**0.5,
        }

    def run(
        self,
        experts: nn.Module,
        rows: torch.Tensor,
        counts: torch.Tensor,
        row_weights: torch.Tensor,
        matmul: GroupedMatmul,
    ) -> torch.Tensor:
        gate_up_proj = local_experts(experts.get_parameter("gate_up_proj"))
        down_proj = local_experts(experts.get_parameter("down_proj"))
        adapter = experts_adapter(experts)
        gate_up = matmul(rows, gate_up_proj.transpose(1, 2), counts)
        if adapter is not None:
            gate_up = gate_up + adapter.update("gate_up_proj", rows, counts)
        gate, up = gate_up.chunk(2, dim=-1)
        act_fn: Any = experts.act_fn
        # each row weighed by its routing weight before the down projection (combine only sums: see moe.dispatch)
        activation = weigh_rows(act_fn(gate) * up, row_weights)
        output = matmul(activation, down_proj.transpose(1, 2), counts)
        if adapter is not None:
            output = output + adapter.update("down_proj", activation, counts)
        return output


class GptOssLayout(ExpertsLayout):
    """GPT-OSS's experts (see the module docstring): ``down(clamped_swiglu(x @ gate_up + b1)) + b2``, the routing
    weight applied to that output (the bias comes after the down projection, so the weight cannot move before
    it), as ``GptOssExperts.forward`` computes it."""

    weights = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    arguments = ("hidden_states", "router_indices", "routing_weights")
    math = (
        "GPT-OSS's clamped SwiGLU (gain alpha, limit) on gate_up_proj's interleaved columns plus its bias, through "
        "down_proj plus its bias, weighted"
    )
    settings = ("alpha", "limit")

    def problem(self, experts: nn.Module) -> str | None:
        if any(True for _ in experts.children()):
            return "holds submodules beside its biased stacked weights"
        missing = [name for name in self.settings if not _is_number(getattr(experts, name, None))]
        if missing:
            return f"has no number {' or '.join(missing)} (GPT-OSS's clamped SwiGLU's gain and limit)"
        shapes = {name: tuple(experts.get_parameter(name).shape) for name in self.weights}
        if len(shapes["gate_up_proj"]) != 3:
            return f"has gate_up_proj {shapes['gate_up_proj']}, not GPT-OSS's [E, hidden, 2 * ffn]"
        experts_count, hidden, double_ffn = shapes["gate_up_proj"]
        expected = {
            "gate_up_proj_bias": (experts_count, double_ffn),
            "down_proj": (experts_count, double_ffn // 2, hidden),
            "down_proj_bias": (experts_count, hidden),
        }
        if double_ffn % 2 or any(shapes[name] != shape for name, shape in expected.items()):
            return (
                f"holds {shapes}, not GPT-OSS's gate_up_proj [E, hidden, 2 * ffn], gate_up_proj_bias [E, 2 * ffn], "
                "down_proj [E, ffn, hidden], down_proj_bias [E, hidden]"
            )
        return None

    def probe_weights(
        self, experts: nn.Module, num_experts: int, hidden: int, ffn: int
    ) -> dict[str, torch.Tensor]:
        # gate and up of about `limit` in size: the up's clamp bites on about a third of them, the gate's on a
        # sixth, and the gain and the interleave change every one
        scale = max(1.0, _setting(experts, "limit"))
        return {
            "gate_up_proj": torch.randn(num_experts, hidden, 2 * ffn) * scale / hidden**0.5,
            "gate_up_proj_bias": torch.randn(num_experts, 2 * ffn),
            "down_proj": torch.randn(num_experts, ffn, hidden) / ffn**0.5,
            "down_proj_bias": torch.randn(num_experts, hidden),
        }

    def run(
        self,
        experts: nn.Module,
        rows: torch.Tensor,
        counts: torch.Tensor,
        row_weights: torch.Tensor,
        matmul: GroupedMatmul,
    ) -> torch.Tensor:
        gate_up_proj, gate_up_bias, down_proj, down_bias = (
            local_experts(experts.get_parameter(name)) for name in self.weights
        )
        gate_up = matmul(rows, gate_up_proj, counts) + bias_by_row(gate_up_bias, counts, rows.shape[0])
        activation = clamped_swiglu(gate_up, _setting(experts, "alpha"), _setting(experts, "limit"))
        output = matmul(activation, down_proj, counts) + bias_by_row(down_bias, counts, rows.shape[0])
        # weighed in the output's dtype (a bias may have promoted it), then cast to the rows' (transformers'
        # index_add casts so)
        return weigh_rows(output, row_weights).to(rows.dtype)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation of ``[N, 2 * ffn]`` with gate and up interleaved: the gate clamped from above
    at ``limit``, the up on both sides, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def bias_by_row(bias: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert's bias: ``bias [E, width]`` repeated ``counts [E]`` times -> ``[rows, width]`` (the
    number of rows given, so that no count is read on the host)."""
    return bias.repeat_interleave(counts, dim=0, output_size=rows)


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts (FSDP has gathered its own dimension by now); the gradient flows back into the DTensor."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _setting(experts: nn.Module, name: str) -> float:
    """A number the experts module holds as a plain attribute (GPT-OSS's ``alpha``, ``limit``)."""
    value: Any = getattr(experts, name)
    return float(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


STACKED = StackedLayout()
GPT_OSS = GptOssLayout()
LAYOUTS = (STACKED, GPT_OSS)


def layout_named(experts: nn.Module) -> ExpertsLayout | None:
    """The layout whose parameter names are exactly ``experts``' own (``None``: none is)."""
    own = sorted(name for name, _ in experts.named_parameters(recurse=False))
    return next((layout for layout in LAYOUTS if sorted(layout.weights) == own), None)


def describe_layouts() -> str:
    """The layouts by their parameters, for a refusal."""
    return (
        f"transformers' stacked experts ({' and '.join(STACKED.weights)}, no biases) or GPT-OSS's biased ones "
        f"({', '.join(GPT_OSS.weights)})"
    )


def probe_parameters(
    layout: ExpertsLayout, experts: nn.Module, num_experts: int, hidden: int, ffn: int
) -> Mapping[str, nn.Parameter]:
    """:meth:`ExpertsLayout.probe_weights` as frozen Parameters."""
    return {
        name: nn.Parameter(value, requires_grad=False)
        for name, value in layout.probe_weights(experts, num_experts, hidden, ffn).items()
    }
