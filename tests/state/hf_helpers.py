"""Small random Hugging Face Qwen3 checkpoints, made offline with ``transformers`` (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_theta=10000.0,
)


def make_hf_checkpoint(directory: Path, *, seed: int = 0, **overrides: Any) -> Any:
    """``save_pretrained`` of a random fp32 ``transformers.Qwen3ForCausalLM``; returns the model (eval mode).

    Norm weights are randomised too (transformers starts them at 1), so that a swapped norm would show.
    """
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(directory)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def load_transformers(directory: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    return model.eval()


def config_json(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "config.json").read_text()))


def batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
