"""Low-rank adapters (LoRA) on a linear layer, ``y = x W^T + b + (alpha / r) * B(A(dropout(x)))``, and on stacked
experts.

:class:`LoRALinear` *is* an ``nn.Linear`` holding the frozen base weight and bias under their own names, with
the adapter as two bias-free linears beside them: ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``). The
base's state-dict keys stay what they were (``q_proj.weight``), the adapter's are ``peft``'s
(``q_proj.lora_A.weight``), so Hugging Face mappings, checkpoints and exports see the model they knew plus two
tensors per adapted layer. Parallel plans see an ``nn.Linear`` too; tensor parallelism shards the adapter with
the base (:mod:`lightning_d9d.plans.lora`).

``B`` starts at zero, so an adapted model computes exactly what its base does until the first optimizer step;
``A`` is drawn as ``peft`` draws it (Kaiming-uniform with ``a = sqrt(5)``), from a seed and its name, so every
layout initialises the same adapter (:func:`init_adapter_`).

Stacked experts (``E`` weights of one shape in one ``[E, ., .]`` Parameter, run by grouped GEMMs) get
:class:`ExpertsLoRA`, held by the experts module as ``lora``: for each adapted weight (expert ``e`` maps ``in`` to
``out`` features) ``lora_A.<weight> [E, r, in]`` and ``lora_B.<weight> [E, out, r]``, each expert's ``A_e`` and
``B_e`` shaped as a linear layer's. The expert dimension comes first, as in the weights, so expert parallelism
splits the adapters with their experts. The experts' forward adds ``(alpha / r) * B_e(A_e(dropout(x)))`` to the
rows of expert ``e`` with two grouped GEMMs of width ``r`` (:meth:`ExpertsLoRA.update`): ``W_e + B_e A_e`` is
never formed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels import grouped_mm
from lightning_d9d.modules.init import init_param_, zeros_fill

# The attribute an adapted experts module holds its ExpertsLoRA under (state-dict keys <experts>.lora.lora_A.<weight>)
EXPERTS_ADAPTER = "lora"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a trainable low-rank update; the base weight and bias are the adapted layer's own
    Parameters (shared, not copied: build it with :meth:`from_linear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_linear(
        cls,
        base: nn.Linear,
        rank: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> LoRALinear:
        """An adapted layer around ``base``'s own weight and bias (the same Parameters: the base is not copied);
        the adapter on ``base``'s device, in ``dtype`` (default: the base weight's), not initialised yet."""
        with torch.device("meta"):  # the placeholder base tensors are replaced below: never allocate them
            adapted = cls(base.in_features, base.out_features, rank, alpha, dropout=dropout, bias=False)
        adapted.weight = base.weight
        adapted.bias = base.bias
        factory = {"device": base.weight.device, "dtype": dtype or base.weight.dtype}
        adapted.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        adapted.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        adapted.train(base.training)
        return adapted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def kaiming_uniform_fill(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """``nn.Linear``'s (and ``peft``'s) draw for ``lora_A``: uniform in ``±1/sqrt(fan_in)``, which is
    Kaiming-uniform with ``a = sqrt(5)``."""
    bound = 1.0 / math.sqrt(tensor.shape[-1])
    tensor.uniform_(-bound, bound, generator=generator)


def init_adapter_(layer: LoRALinear | ExpertsLoRA, name: str, seed: int) -> None:
    """``A`` drawn from ``(seed, its state-dict key)`` (``name.lora_A.weight``; for experts ``name.lora_A.<weight>``,
    all experts' at once), ``B`` zero: the same on every layout (each tensor drawn whole and cut locally,
    :func:`~lightning_d9d.modules.init.init_param_`)."""
    if isinstance(layer, ExpertsLoRA):
        for weight in layer.weights:
            init_param_(
                layer.lora_A.get_parameter(weight), f"{name}.lora_A.{weight}", seed, kaiming_uniform_fill
            )
            init_param_(layer.lora_B.get_parameter(weight), f"{name}.lora_B.{weight}", seed, zeros_fill)
        return
    init_param_(layer.lora_A.weight, f"{name}.lora_A.weight", seed, kaiming_uniform_fill)
    init_param_(layer.lora_B.weight, f"{name}.lora_B.weight", seed, zeros_fill)


# ------------------------------------------------------------------------------------------ stacked experts
@dataclass(frozen=True)
class StackedWeight:
    """A stacked-experts weight as LoRA sees it: ``num_experts`` matrices, each mapping ``in_features`` to
    ``out_features``, held ``[E, out, in]`` (``out_first``: a linear layer's layout, transformers') or ``[E, in,
    out]`` (what a grouped GEMM reads without a transpose: ours)."""

    num_experts: int
    in_features: int
    out_features: int
    out_first: bool

    @classmethod
    def of(cls, weight: torch.Tensor, *, out_first: bool) -> StackedWeight:
        experts, first, second = weight.shape
        if out_first:
            return cls(experts, in_features=second, out_features=first, out_first=True)
        return cls(experts, in_features=first, out_features=second, out_first=False)


class ExpertFactors(nn.Module):
    """One side of per-expert adapters: a ``[E, ., .]`` Parameter per adapted weight, under the weight's name.
    ``zero``: the ``B`` side (starts at zero); otherwise ``A``, each expert's drawn as ``nn.Linear`` draws a
    weight. The LoRA plan gives both their seeded start (:func:`init_adapter_`); :meth:`reset_parameters` is
    what an initialiser that knows nothing of adapters calls."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, int, int]],
        *,
        zero: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.zero = zero
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for param in self.parameters():
            if self.zero:
                param.zero_()
            else:
                bound = 1.0 / math.sqrt(param.shape[-1])
                param.uniform_(-bound, bound)


class ExpertsLoRA(nn.Module):
    """Per-expert low-rank adapters of a stacked-experts module's ``weights`` (see the module docstring), scaled
    by ``alpha / rank``, with dropout on their input. Built on ``device`` in ``dtype``, not initialised yet
    (:func:`init_adapter_`)."""

    def __init__(
        self,
        weights: Mapping[str, StackedWeight],
        rank: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        a_shapes = {name: (w.num_experts, rank, w.in_features) for name, w in self.weights.items()}
        b_shapes = {name: (w.num_experts, w.out_features, rank) for name, w in self.weights.items()}
        self.lora_A = ExpertFactors(a_shapes, zero=False, device=device, dtype=dtype)
        self.lora_B = ExpertFactors(b_shapes, zero=True, device=device, dtype=dtype)

    def update(self, weight: str, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to ``weight``'s output for ``rows [N, in]`` grouped by (this rank's) expert:
        ``[N, out]``, two grouped GEMMs of width ``rank``. ``auto``'s grouped GEMM: the experts' own backend may
        refuse a width of a few features."""
        a = _local(self.lora_A.get_parameter(weight))
        b = _local(self.lora_B.get_parameter(weight))
        low = grouped_mm(self.lora_dropout(rows), a.transpose(1, 2), tokens_per_expert, backend="auto")
        return grouped_mm(low, b.transpose(1, 2), tokens_per_expert, backend="auto") * self.scaling

    def extra_repr(self) -> str:
        return f"weights={sorted(self.weights)}, rank={self.rank}, alpha={self.alpha}"


def experts_adapter(experts: nn.Module) -> ExpertsLoRA | None:
    """The adapters ``experts`` holds (under :data:`EXPERTS_ADAPTER`), if any."""
    adapter = experts._modules.get(EXPERTS_ADAPTER)
    return adapter if isinstance(adapter, ExpertsLoRA) else None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: split over ep the adapters are ``DTensor``s (FSDP has gathered its own dimension by
    now), and the kernels take plain tensors; the gradient flows back into the ``DTensor``."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
