"""White-box models with Hugging Face parameter names, their parallel plans and initialisation."""

from lightning_d9d.models.qwen3 import Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model

__all__ = ["Qwen3Config", "Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3Model"]
