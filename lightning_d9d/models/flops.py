"""Training FLOPs per token of a decoder-only language model: one formula for our models and ``transformers``'.

``6 * N_trained + 4 * N_frozen + 12 * H * head_dim * (L_full * T + L_window * min(T, W))`` for sequences of
``T`` tokens.

``N`` is what a token multiplies through: every parameter but the input embedding (a lookup, not a matmul), the
LM head counted even when tied to the embedding (a real matmul), and of routed experts only the share a token
runs through (``num_experts_per_tok / num_experts``; the router and shared experts whole). A multiply-add is 2
FLOPs: a trained weight costs 2 in the forward, 2 for its input's gradient and 2 for its own gradient; a frozen
weight (LoRA's base, a user's frozen modules) computes no gradient of its own, so 2 + 2. The second term is
attention's two ``T x T`` matmuls (``QK^T`` and ``AV``: 2 matmuls * 2 FLOPs * 3) for ``L`` layers of ``H`` query
heads, without the causal mask's halving, as in the PaLM / torchtitan MFU convention; a sliding-window layer
(window ``W``: Mistral's every layer, Gemma 2/3's and GPT-OSS's ``"sliding_attention"`` layers) attends at most
``W`` keys a query, so it counts ``min(T, W)`` for ``T``. Recomputation is not counted: these are model FLOPs, not
hardware FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The module name routed experts live under, in our MoE blocks and transformers' (fused or one module each).
EXPERTS_MODULE = "experts"


@dataclass(frozen=True)
class FlopParams:
    """``N`` split by what its weights compute in the backward: trained ones their own gradient, frozen ones not."""

    trained: int
    frozen: int = 0

    def __add__(self, other: FlopParams) -> FlopParams:
        return FlopParams(self.trained + other.trained, self.frozen + other.frozen)


@dataclass(frozen=True)
class AttentionShape:
    """What attention's ``T x T`` matmuls cost per token: ``layers`` of ``heads`` query heads of ``head_dim``, of
    which ``windowed_layers`` attend at most ``window`` keys a query."""

    layers: int
    heads: int
    head_dim: int
    windowed_layers: int = 0
    window: int | None = None

    @classmethod
    def of(cls, config: Any) -> AttentionShape | None:
        """From a model config (ours or ``transformers``'): ``num_hidden_layers``, ``num_attention_heads`` and
        ``head_dim`` (``hidden_size // num_attention_heads`` where it has none); None where a size is missing.
        Sliding windows as ``transformers`` applies them: ``sliding_window`` on the ``layer_types`` that say
        ``"sliding_attention"``, or on every layer of a config without ``layer_types`` (unless
        ``use_sliding_window`` is False)."""
        layers = _config_int(config, "num_hidden_layers")
        heads = _config_int(config, "num_attention_heads")
        if layers is None or not heads:
            return None
        head_dim = _config_int(config, "head_dim")
        if head_dim is None:
            hidden = _config_int(config, "hidden_size")
            if hidden is None:
                return None
            head_dim = hidden // heads
        window = _config_int(config, "sliding_window")
        if not window:
            return cls(layers, heads, head_dim)
        layer_types = _config_value(config, "layer_types")
        if isinstance(layer_types, (list, tuple)):
            windowed = sum(kind == "sliding_attention" for kind in layer_types[:layers])
        elif _config_value(config, "use_sliding_window") is False:
            windowed = 0
        else:
            windowed = layers
        return cls(layers, heads, head_dim, windowed, window)

    def keys_per_query(self, seq_len: int) -> int:
        """Keys a query meets summed over the layers (the causal mask not halved): ``T`` a full layer,
        ``min(T, W)`` a windowed one."""
        windowed = min(seq_len, self.window) if self.window else seq_len
        return (self.layers - self.windowed_layers) * seq_len + self.windowed_layers * windowed


def training_flops_per_token(params: FlopParams, attention: AttentionShape, seq_len: int) -> int:
    """Model FLOPs of one trained token (forward + backward): the module docstring's formula."""
    weights = 6 * params.trained + 4 * params.frozen
    return weights + 12 * attention.heads * attention.head_dim * attention.keys_per_query(seq_len)


def routed_experts(config: Any) -> tuple[int, int] | None:
    """``(num_experts_per_tok, num_experts)`` of an MoE config (``num_experts``, ``num_local_experts`` or
    ``n_routed_experts``); None for a dense one."""
    experts = next(
        (
            n
            for name in ("num_experts", "num_local_experts", "n_routed_experts")
            if (n := _config_int(config, name))
        ),
        None,
    )
    top_k = _config_int(config, "num_experts_per_tok")
    return (top_k, experts) if experts and top_k else None


def flop_params(model: nn.Module, experts: tuple[int, int] | None = None) -> FlopParams:
    """``N`` of ``model`` counted from its parameters, as the module docstring says, split into trained
    (``requires_grad``) and frozen: each Parameter once (a ``DTensor`` by its global size), the weights of
    ``nn.Embedding`` modules left out unless another module uses them too (a tied head), and the parameters
    under a module named ``experts`` scaled by ``experts = (num_experts_per_tok, num_experts)``.

    It counts the layers ``model`` holds: a pipeline rank's model holds only its stages' layers."""
    counted: set[int] = set()
    dense, routed = [0, 0], [0, 0]  # [trained, frozen]
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue  # a lookup; a tied head's weight is counted through the head
        in_experts = EXPERTS_MODULE in module_name.split(".")
        for param in module.parameters(recurse=False):
            if id(param) in counted:
                continue
            counted.add(id(param))
            (routed if in_experts else dense)[0 if param.requires_grad else 1] += _numel(param)
    if experts is not None:
        top_k, num_experts = experts
        routed = [count * top_k // num_experts for count in routed]
    return FlopParams(trained=dense[0] + routed[0], frozen=dense[1] + routed[1])


def _numel(param: torch.Tensor) -> int:
    return int(param.numel())  # a DTensor's numel is its global size


def _config_value(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _config_int(config: Any, name: str) -> int | None:
    value = _config_value(config, name)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
