"""A tiny model whose layout differs from its checkpoint's, the mapper between them, and checkpoint helpers.

On disk (HF-like): separate ``q_proj``/``k_proj``/``v_proj`` and one tensor per expert, under ``model.``.
In the module: fused ``qkv``, experts stacked as ``[E, ...]`` (``w2`` also transposed), no ``model.`` prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_d9d.state import (
    Concat,
    ModelStateMapper,
    Parallel,
    Rename,
    Sequential,
    Stack,
    Transpose,
    per_layer,
)


@dataclass(frozen=True)
class TinyConfig:
    layers: int = 2
    dim: int = 6
    heads: int = 3
    kv_heads: int = 1
    head_dim: int = 2
    experts: int = 3
    ffn: int = 5
    vocab: int = 7

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o = nn.Linear(cfg.q_size, cfg.dim, bias=False)


class Experts(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(cfg.experts, cfg.ffn, cfg.dim))
        self.w2 = nn.Parameter(torch.randn(cfg.experts, cfg.ffn, cfg.dim))  # disk has [dim, ffn] per expert


class Layer(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.experts = Experts(cfg)
        self.norm = nn.Parameter(torch.randn(cfg.dim))


class TinyModel(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.Parameter(torch.randn(cfg.dim))
        self.register_buffer("scale", torch.randn(cfg.dim))  # a persistent buffer travels too


def disk_state(cfg: TinyConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """A random checkpoint in the disk layout."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    state = {"model.embed_tokens.weight": rand(cfg.vocab, cfg.dim), "model.norm.weight": rand(cfg.dim)}
    state["model.scale"] = rand(cfg.dim)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rand(cfg.q_size, cfg.dim)
        state[p + "self_attn.k_proj.weight"] = rand(cfg.kv_size, cfg.dim)
        state[p + "self_attn.v_proj.weight"] = rand(cfg.kv_size, cfg.dim)
        state[p + "self_attn.o_proj.weight"] = rand(cfg.dim, cfg.q_size)
        state[p + "input_layernorm.weight"] = rand(cfg.dim)
        for e in range(cfg.experts):
            state[p + f"mlp.experts.{e}.w1.weight"] = rand(cfg.ffn, cfg.dim)
            state[p + f"mlp.experts.{e}.w2.weight"] = rand(cfg.dim, cfg.ffn)
    return state


def module_state(cfg: TinyConfig, disk: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the module must hold after loading ``disk``, computed directly (not through the mappers)."""
    state = {
        "embed.weight": disk["model.embed_tokens.weight"],
        "final_norm": disk["model.norm.weight"],
        "scale": disk["model.scale"],
    }
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        attn = [disk[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        state[f"layers.{i}.attn.qkv.weight"] = torch.cat(attn, dim=0)
        state[f"layers.{i}.attn.o.weight"] = disk[p + "self_attn.o_proj.weight"]
        state[f"layers.{i}.norm"] = disk[p + "input_layernorm.weight"]
        experts = range(cfg.experts)
        state[f"layers.{i}.experts.w1"] = torch.stack(
            [disk[p + f"mlp.experts.{e}.w1.weight"] for e in experts]
        )
        w2 = torch.stack([disk[p + f"mlp.experts.{e}.w2.weight"] for e in experts])
        state[f"layers.{i}.experts.w2"] = w2.transpose(1, 2).contiguous()
    return state


def tiny_mapper(cfg: TinyConfig) -> ModelStateMapper:
    """Disk → module, built the way a model's HF mapping would be: per-layer template, then prefix renames."""
    experts = range(cfg.experts)
    layer = Sequential(
        [
            Parallel(
                [
                    Rename({"input_layernorm.weight": "norm", "self_attn.o_proj.weight": "attn.o.weight"}),
                    Concat(
                        [f"self_attn.{n}_proj.weight" for n in "qkv"],
                        "attn.qkv.weight",
                        dim=0,
                        sizes=[cfg.q_size, cfg.kv_size, cfg.kv_size],
                    ),
                    Stack([f"mlp.experts.{e}.w1.weight" for e in experts], "experts.w1"),
                    Stack([f"mlp.experts.{e}.w2.weight" for e in experts], "experts.w2"),
                ]
            ),
            Transpose(["experts.w2"], 1, 2),
        ]
    )
    layers = per_layer("model.layers.{i}.", range(cfg.layers), layer)
    top = Rename(
        {
            "model.embed_tokens.weight": "embed.weight",
            "model.norm.weight": "final_norm",
            "model.scale": "scale",
        }
    )
    return Parallel([top, Sequential([layers, Rename.prefix(layers.output_keys(), "model.", "")])])


def write_checkpoint(directory: Path, state: dict[str, Tensor], files: int = 2) -> list[str]:
    """An HF-style sharded checkpoint of ``state`` (keys dealt round-robin over ``files`` shards)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"model-{n + 1:05d}-of-{files:05d}.safetensors" for n in range(files)]
    shards: list[dict[str, Tensor]] = [{} for _ in names]
    weight_map = {}
    for position, (key, tensor) in enumerate(state.items()):
        shards[position % files][key] = tensor.contiguous()
        weight_map[key] = names[position % files]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
    total = sum(t.nbytes for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


def read_checkpoint(directory: Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint, read with plain safetensors (independent of our reader)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, Tensor] = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                assert key not in state, f"{key} in two shards"
                state[key] = handle.get_tensor(key).clone()
    return state


def assert_same_state(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Same keys, dtypes, shapes and bytes."""
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype, (key, got.dtype, value.dtype)
        assert got.shape == value.shape, (key, got.shape, value.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
