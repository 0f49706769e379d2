"""Low-rank adapters (LoRA) on a linear layer: ``y = x W^T + b + (alpha / r) * B(A(dropout(x)))``.

:class:`LoRALinear` *is* an ``nn.Linear`` holding the frozen base weight and bias under their own names, with
the adapter as two bias-free linears beside them: ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``). The
base's state-dict keys stay what they were (``q_proj.weight``), the adapter's are ``peft``'s
(``q_proj.lora_A.weight``), so Hugging Face mappings, checkpoints and exports see the model they knew plus two
tensors per adapted layer. Parallel plans see an ``nn.Linear`` too; tensor parallelism shards the adapter with
the base (:mod:`lightning_d9d.plans.lora`).

``B`` starts at zero, so an adapted model computes exactly what its base does until the first optimizer step;
``A`` is drawn as ``peft`` draws it (Kaiming-uniform with ``a = sqrt(5)``), from a seed and its name, so every
layout initialises the same adapter (:func:`init_adapter_`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_d9d.modules.init import init_param_, zeros_fill


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


def init_adapter_(layer: LoRALinear, name: str, seed: int) -> None:
    """``A`` drawn from ``(seed, name.lora_A.weight)``, ``B`` zero: the same on every layout (each tensor drawn
    whole and cut locally, :func:`~lightning_d9d.modules.init.init_param_`)."""
    init_param_(layer.lora_A.weight, f"{name}.lora_A.weight", seed, kaiming_uniform_fill)
    init_param_(layer.lora_B.weight, f"{name}.lora_B.weight", seed, zeros_fill)
