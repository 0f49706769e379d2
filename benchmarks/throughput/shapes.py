"""The model shapes ``train_throughput.py`` measures (``--model``, ``--layers``): Qwen3's dense shapes, the MoE
shapes, the model class for a config, the shapes' names in the tables, and the FLOPs a token costs at a shape."""

from __future__ import annotations

import argparse
from typing import Any


def _config(args: argparse.Namespace) -> Any:
    from lightning_d9d.models import Qwen3Config

    layers = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.model in ("moe", "moe_tiny", "moe_large"):
        return _moe_config(args.model, **layers)
    if args.model in QWEN3_SHAPES:
        return Qwen3Config.qwen3_0_6b(**{**QWEN3_SHAPES[args.model], **layers})
    return Qwen3Config.qwen3_0_6b(**layers) if args.model == "0.6b" else Qwen3Config.tiny(**layers)


# Qwen3's released dense shapes beyond 0.6B (their config.json: hidden, MLP width, layers, heads; head_dim 128,
# 8 key-value heads, tied embeddings, vocabulary 151,936 as 0.6B)
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
    },
    "4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
}


def _moe_config(model: str, **overrides: Any) -> Any:
    """The MoE shape: 16 layers, hidden 1024, Qwen3 attention (16 heads, 8 KV heads, head_dim 128), 64 experts
    of width 384, top-8 (renormalised, as Qwen3-MoE), every layer sparse, Qwen3's vocabulary. Router losses
    off on both sides (the HF plain loop computes only the LM loss). ``moe_large``: Qwen3-30B-A3B's layer
    (hidden 2048, 32 heads, 4 KV heads, 128 experts of 768, top-8, untied head) at 6 layers, what fits one
    H200 with fp32 AdamW state (``--layers`` changes it). ``moe_tiny``: the CPU smoke shape."""
    from lightning_d9d.models import Qwen3MoeConfig

    if model == "moe_tiny":
        return Qwen3MoeConfig.tiny(output_router_logits=False, mlp_only_layers=[], **overrides)
    if model == "moe_large":
        return Qwen3MoeConfig(
            **{
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 6144,
                "num_hidden_layers": 6,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "norm_topk_prob": True,
                "output_router_logits": False,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
                **overrides,
            }
        )
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        output_router_logits=False,
        rope_theta=1e6,
    )


def _model_class(config: Any) -> Any:
    from lightning_d9d.models import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM


MODEL_NAMES = {
    "0.6b": "Qwen3-0.6B shape",
    "1.7b": "Qwen3-1.7B shape",
    "4b": "Qwen3-4B shape",
    "8b": "Qwen3-8B shape",
    "tiny": "Qwen3 tiny",
    "moe": "Qwen3-MoE 16 layers, hidden 1024, 64 experts of 384, top-8 (active-parameter MFU)",
    "moe_large": "Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8; active-parameter MFU)",
    "moe_tiny": "Qwen3-MoE tiny",
}


def flops_per_token(args: argparse.Namespace) -> int:
    import torch

    config = _config(args)
    with torch.device("meta"):
        return int(_model_class(config)(config).num_flops_per_token(args.seq_len))
