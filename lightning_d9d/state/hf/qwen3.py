"""Qwen3 (dense): Hugging Face ``Qwen3ForCausalLM`` files ↔ our ``Qwen3ForCausalLM``.

Our module uses HF's parameter names, so the mapping is the identity on the keys the config implies; what it
adds is the key set itself (checked against a file before anything is read), the shapes, and tied embeddings:
with ``tie_word_embeddings`` the files hold no ``lm_head.weight`` and neither do the mapping's keys (the module
lists the shared Parameter once, as ``model.embed_tokens.weight``).
"""

from __future__ import annotations

from typing import Any

from ..compose import Parallel, per_layer
from ..mapper import Identity, ModelStateMapper
from .registry import HFConfig, HFFormat, register_hf_format

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
LAYER = "model.layers.{i}."


def _sizes(config: HFConfig) -> dict[str, int]:
    heads = int(config["num_attention_heads"])
    return {
        "vocab": int(config["vocab_size"]),
        "hidden": int(config["hidden_size"]),
        "ffn": int(config["intermediate_size"]),
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or int(config["hidden_size"]) // heads),
    }


def _layer_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors, relative to ``model.layers.{i}.``."""
    s = _sizes(config)
    q, kv, hidden = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"]
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_norm.weight": (s["head_dim"],),
        "self_attn.k_norm.weight": (s["head_dim"],),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (s["ffn"], hidden),
        "mlp.up_proj.weight": (s["ffn"], hidden),
        "mlp.down_proj.weight": (hidden, s["ffn"]),
    }
    if config.get("attention_bias", False):
        shapes.update(
            {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
                "self_attn.o_proj.bias": (hidden,),
            }
        )
    return shapes


def _top_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    s = _sizes(config)
    shapes = {EMBEDDING: (s["vocab"], s["hidden"]), "model.norm.weight": (s["hidden"],)}
    if not config.get("tie_word_embeddings", False):
        shapes[HEAD] = (s["vocab"], s["hidden"])
    return shapes


def qwen3_hf_shapes(config: HFConfig, layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF Qwen3 checkpoint with this config, and its shape."""
    shapes = _top_shapes(config)
    for i in range(int(config["num_hidden_layers"])):
        prefix = LAYER.format(i=i)
        shapes.update({prefix + key: shape for key, shape in _layer_shapes(config).items()})
    return shapes


def qwen3_from_hf(config: HFConfig, layout: str | None = None) -> ModelStateMapper:
    """HF file keys → our module's keys (the same names; tied head left out on both sides)."""
    layers = per_layer(LAYER, range(int(config["num_hidden_layers"])), Identity(_layer_shapes(config)))
    return Parallel([Identity(_top_shapes(config)), layers])


def qwen3_to_hf(config: HFConfig, layout: str | None = None) -> ModelStateMapper:
    """Our module's keys → HF file keys."""
    return qwen3_from_hf(config, layout).inverse()


def qwen3_tied(config: HFConfig) -> dict[str, str]:
    return {HEAD: EMBEDDING} if config.get("tie_word_embeddings", False) else {}


def qwen3_signature(config: HFConfig) -> dict[str, Any]:
    """The fields that make two Qwen3 configs the same model (weights and computation), normalised.

    ``rope_theta`` sits at the top level in configs written by transformers 4.x and in ``rope_parameters`` since
    5.0; ``head_dim`` and ``num_key_value_heads`` may be left out (then derived as transformers does). Fields that
    change neither the weights nor the result (``max_position_embeddings``, ``initializer_range``, dtypes, token
    ids) are not part of it.
    """
    sizes = _sizes(config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return {
        "vocab_size": sizes["vocab"],
        "hidden_size": sizes["hidden"],
        "intermediate_size": sizes["ffn"],
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["kv_heads"],
        "head_dim": sizes["head_dim"],
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
        "hidden_act": config.get("hidden_act", "silu"),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": None if theta is None else float(theta),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "use_sliding_window": bool(config.get("use_sliding_window", False)),
    }


QWEN3 = register_hf_format(
    HFFormat(
        model_type="qwen3",
        architectures=("Qwen3ForCausalLM",),
        mapping=qwen3_from_hf,
        signature=qwen3_signature,
        hf_shapes=qwen3_hf_shapes,
        tied=qwen3_tied,
    )
)
