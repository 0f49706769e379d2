"""Qwen3-MoE: Hugging Face ``Qwen3MoeForCausalLM`` files ↔ our ``Qwen3MoeForCausalLM``.

Attention, norms, embedding, head, the routers (``mlp.gate.weight``) and the dense layers' MLPs keep their names
and shapes. The routed experts differ in layout; two file layouts are read:

- ``per_expert`` (the default, and what we write): one ``[out, in]`` matrix per expert,
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``. Hub checkpoints hold this, and transformers 5 writes it with
  ``save_pretrained`` (it converts its fused in-memory layout back on save).
- ``fused``: transformers 5's in-memory layout, ``mlp.experts.gate_up_proj [E, 2 * ffn, hidden]`` (gate rows
  first) and ``mlp.experts.down_proj [E, hidden, ffn]``, as a raw ``state_dict()`` saved without conversion
  holds it.

Ours is ``mlp.experts.gate_up_proj [E, hidden, 2 * ffn]`` (gate columns first) and ``mlp.experts.down_proj [E,
ffn, hidden]`` (:class:`~lightning_d9d.modules.moe.GroupedExperts`): stack the experts, swap the last two dims,
and put gate beside up (the fused layout only swaps: its name is ours, transposed). Which layers are sparse
follows transformers' rule (``mlp_only_layers``, ``decoder_sparse_step``).

The routers' selection bias (``router_selection_bias: true`` in the config, ours: auxiliary-loss-free balancing)
has no tensor in transformers' Qwen3-MoE. It is written as ``mlp.gate.e_score_correction_bias [E]`` (fp32),
DeepSeek-V3's name for the same per-expert bias, and read back from it; transformers' Qwen3-MoE loads such a
file with an "unused weights" warning and routes without the bias (which only changes which experts are chosen,
never the weights of the chosen ones).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..compose import Parallel, Sequential, per_layer
from ..mapper import Concat, Identity, ModelStateMapper, Rename, Stack, Transpose
from .qwen3 import LAYER, _layer_shapes, _top_shapes, qwen3_signature, qwen3_tied
from .registry import HFConfig, HFFormat, register_hf_format

PER_EXPERT = "per_expert"
FUSED = "fused"
# Our router's selection bias <-> its name in the file (DeepSeek-V3's), relative to a layer.
EXPERT_BIAS = "mlp.gate.expert_bias"
FILE_EXPERT_BIAS = "mlp.gate.e_score_correction_bias"


def num_experts(config: HFConfig) -> int:
    """``num_experts`` as transformers 4.x writes it, or ``num_local_experts`` as 5.x does (0 when absent)."""
    value = config.get("num_experts", config.get("num_local_experts"))
    return int(value or 0)


def sparse_layers(config: HFConfig) -> list[int]:
    """The decoder layers with experts (transformers' rule: not in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer, and only when there are experts)."""
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    experts = num_experts(config)
    return [
        i
        for i in range(int(config["num_hidden_layers"]))
        if i not in dense and experts > 0 and (i + 1) % step == 0
    ]


def _moe_sizes(config: HFConfig) -> tuple[int, int, int]:
    return num_experts(config), int(config["hidden_size"]), int(config["moe_intermediate_size"])


def _attention_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """One layer's tensors outside its MLP (as Qwen3's), relative to ``model.layers.{i}.``."""
    return {key: shape for key, shape in _layer_shapes(config).items() if not key.startswith("mlp.")}


def _sparse_mlp_shapes(config: HFConfig, layout: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP tensors in the file, relative to ``model.layers.{i}.``."""
    experts, hidden, ffn = _moe_sizes(config)
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (experts, hidden)}
    if config.get("router_selection_bias", False):
        shapes[FILE_EXPERT_BIAS] = (experts,)
    if layout == FUSED:
        shapes["mlp.experts.gate_up_proj"] = (experts, 2 * ffn, hidden)
        shapes["mlp.experts.down_proj"] = (experts, hidden, ffn)
        return shapes
    for e in range(experts):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = (ffn, hidden)
        shapes[f"mlp.experts.{e}.up_proj.weight"] = (ffn, hidden)
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (hidden, ffn)
    return shapes


def _experts_from_hf(config: HFConfig, layout: str) -> ModelStateMapper:
    """A sparse layer's expert tensors: file layout → our stacked ``[E, in, out]`` (keys relative to the layer)."""
    experts, _, ffn = _moe_sizes(config)
    gate_up, down = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
    if layout == FUSED:
        return Transpose([gate_up, down], 1, 2)

    def stacked(name: str) -> ModelStateMapper:
        # the per-expert matrices [out, in] -> ours [E, in, out], under the intermediate key mlp.experts.<name>
        ours = f"mlp.experts.{name}"
        return Sequential(
            [Stack([f"mlp.experts.{e}.{name}.weight" for e in range(experts)], ours), Transpose([ours], 1, 2)]
        )

    halves = ["mlp.experts.gate_proj", "mlp.experts.up_proj"]
    return Parallel(
        [
            Sequential(
                [Parallel([stacked("gate_proj"), stacked("up_proj")]), Concat(halves, gate_up, 2, [ffn, ffn])]
            ),
            stacked("down_proj"),
        ]
    )


def _layer_from_hf(config: HFConfig, layout: str, sparse: bool) -> ModelStateMapper:
    if not sparse:
        return Identity(_layer_shapes(config))
    parts = [Identity([*_attention_shapes(config), "mlp.gate.weight"]), _experts_from_hf(config, layout)]
    if config.get("router_selection_bias", False):
        parts.append(Rename({FILE_EXPERT_BIAS: EXPERT_BIAS}))
    return Parallel(parts)


def qwen3_moe_hf_shapes(config: HFConfig, layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF Qwen3-MoE checkpoint with this config (in ``layout``), and its shape."""
    layout = layout or PER_EXPERT
    sparse = set(sparse_layers(config))
    shapes = _top_shapes(config)
    for i in range(int(config["num_hidden_layers"])):
        prefix = LAYER.format(i=i)
        layer = (
            {**_attention_shapes(config), **_sparse_mlp_shapes(config, layout)}
            if i in sparse
            else _layer_shapes(config)
        )
        shapes.update({prefix + key: shape for key, shape in layer.items()})
    return shapes


def qwen3_moe_from_hf(config: HFConfig, layout: str | None = None) -> ModelStateMapper:
    """HF file keys (in ``layout``) → our module's keys."""
    layout = layout or PER_EXPERT
    sparse = set(sparse_layers(config))
    layers = per_layer(
        LAYER, range(int(config["num_hidden_layers"])), lambda i: _layer_from_hf(config, layout, i in sparse)
    )
    return Parallel([Identity(_top_shapes(config)), layers])


def qwen3_moe_to_hf(config: HFConfig, layout: str | None = None) -> ModelStateMapper:
    """Our module's keys → HF file keys (in ``layout``)."""
    return qwen3_moe_from_hf(config, layout).inverse()


def detect_qwen3_moe_layout(keys: Collection[str]) -> str | None:
    return FUSED if any(key.endswith(".mlp.experts.gate_up_proj") for key in keys) else PER_EXPERT


def qwen3_moe_signature(config: HFConfig) -> dict[str, Any]:
    """Qwen3's signature plus the fields that shape the experts and the routing. The router loss coefficients
    change training, not the weights or the forward, so they are left out."""
    return {
        **qwen3_signature(config),
        "num_experts": num_experts(config),
        "num_experts_per_tok": int(config.get("num_experts_per_tok", 0) or 0),
        "moe_intermediate_size": int(config.get("moe_intermediate_size", 0) or 0),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "sparse_layers": sparse_layers(config),
        "router_selection_bias": bool(config.get("router_selection_bias", False)),
    }


QWEN3_MOE = register_hf_format(
    HFFormat(
        model_type="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        mapping=qwen3_moe_from_hf,
        signature=qwen3_moe_signature,
        hf_shapes=qwen3_moe_hf_shapes,
        tied=qwen3_tied,
        layouts=(PER_EXPERT, FUSED),
        detect_layout=detect_qwen3_moe_layout,
    )
)
