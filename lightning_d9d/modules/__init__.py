"""Building blocks the white-box models are made of: norms, RoPE, attention, MLPs, losses, initialisation."""

from lightning_d9d.modules.attention import Attention, repeat_kv
from lightning_d9d.modules.init import (
    canonical_param_name,
    init_param_,
    normal_fill,
    ones_fill,
    param_seed,
    zeros_fill,
)
from lightning_d9d.modules.loss import CausalLMLoss, CountedLoss, causal_lm_loss
from lightning_d9d.modules.mlp import SwiGLU
from lightning_d9d.modules.norm import RMSNorm
from lightning_d9d.modules.rope import RotaryEmbedding, apply_rotary, rope_inverse_frequencies, rotate_half

__all__ = [
    "Attention",
    "CausalLMLoss",
    "CountedLoss",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "canonical_param_name",
    "causal_lm_loss",
    "init_param_",
    "normal_fill",
    "ones_fill",
    "param_seed",
    "repeat_kv",
    "rope_inverse_frequencies",
    "rotate_half",
    "zeros_fill",
]
