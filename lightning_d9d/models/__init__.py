"""White-box models with Hugging Face parameter names, their parallel plans and initialisation."""

from lightning_d9d.models.qwen3 import Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from lightning_d9d.models.qwen3_moe import (
    Qwen3MoeConfig,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    Qwen3MoeStage,
)

__all__ = [
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3Model",
    "Qwen3MoeConfig",
    "Qwen3MoeDecoderLayer",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
    "Qwen3MoeStage",
]
