"""Qwen3-MoE decoder: config, decoder layer, model, initialisation, parallel plan and pipeline trait.

Parameter names are those of Hugging Face's ``Qwen3MoeForCausalLM``; the routed experts are stacked
(:class:`~lightning_d9d.modules.moe.GroupedExperts`, ``[E, in, out]``), which the Hugging Face mapping
(:mod:`lightning_d9d.state.hf.qwen3_moe`) transposes and stacks from the per-expert files::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.gate.weight                            (sparse layers: the router, [E, hidden])
    model.layers.{i}.mlp.experts.{gate,up,down}_proj            (sparse layers: [E, hidden, ffn] / [E, ffn, hidden])
    model.layers.{i}.mlp.{gate,up,down}_proj.weight             (dense layers: ``mlp_only_layers`` and the
                                                                 layers ``decoder_sparse_step`` skips)
    model.norm.weight
    lm_head.weight

Router losses. As in transformers, the load-balancing loss is on when ``output_router_logits`` is set, weighted
by ``router_aux_loss_coef``; ``router_z_loss_coef`` (ours, 0 by default) adds the ST-MoE z-loss. The model never
returns them: each sparse layer's :class:`~lightning_d9d.modules.moe.MoE` attaches its share
(``coef / number of sparse layers`` times its own loss) to its output's backward, so the gradient of whatever the
user computes from the logits includes the router terms exactly once per forward, with no extra output and on
every pipeline stage. The user must not add them again; :meth:`Qwen3MoeForCausalLM.router_loss` reads the
detached value for logging. When the user's loss is scaled before backward (``1 / accumulation steps``,
``1 / micro-batches``), :meth:`Qwen3MoeForCausalLM.set_router_loss_scale` must be given the same factor.

transformers averages the routing fractions and probabilities over the sparse layers before multiplying them;
we average the per-layer losses (the same when there is one sparse layer, and the same value, ``k``, for
perfectly balanced routing).

Parallelism: data (FSDP/HSDP), expert (``ep``, carved from ``dp_shard x cp x tp``), context (``cp``), tensor
(``tp``) and pipeline parallelism. Under tp attention, the dense layers, the embedding and the head split as
Qwen3's (:func:`~lightning_d9d.models.qwen3.tensor_plan`), while each tp rank routes its own positions through
whole MoE weights (:mod:`lightning_d9d.plans.routing`): every token runs through its experts once, the MoE
blocks' gradients are summed over tp, and ep (carved across tp) splits the experts; or, with
``expert_tensor_parallel``, each expert is split over tp and runs the tp group's tokens
(:mod:`lightning_d9d.plans.expert_tensor`). Under cp every rank holds
its load-balanced part of each sequence (:func:`~lightning_d9d.plans.parallelize_context`): attention sees the
whole sequence, RoPE rotates by the global positions, and the MoE blocks, being position-wise, route the local
tokens unchanged. Only the load-balancing loss looks across tokens: each block counts the tokens per expert over
the ranks that hold parts of the same sequences (``MoE.sequence_group``: cp x tp), so that the ranks' losses,
combined like their gradients, are the loss of the whole sequences; the z-loss is a token mean over equal parts
and needs nothing. The expert loads that the auxiliary-loss-free bias update sums are counted per rank and
summed over the ``routing`` view (data x cp x tp ranks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.causal_lm import CausalLM
from lightning_d9d.models.flops import AttentionShape, FlopParams, training_flops_per_token
from lightning_d9d.models.qwen3 import (
    TINY_SHAPE,
    DecoderStage,
    Qwen3DecoderLayer,
    Qwen3Model,
    check_decoder_shape,
    decoder_fields_from_hf,
    decoder_params_without_mlps,
    init_decoder_weights_,
    split_model_over_tp,
)
from lightning_d9d.modules.lora import ExpertFactors
from lightning_d9d.modules.moe import MoE, routers_in
from lightning_d9d.modules.moe.experts import GroupedExperts
from lightning_d9d.modules.moe.router import TopKRouter
from lightning_d9d.plans import (
    DATA_PARALLEL,
    ParallelOptions,
    convert_blocks_to_float8,
    parallelize_blocks,
    parallelize_context,
    parallelize_expert,
    require_degrees,
    route_on_sequence_shards,
)
from lightning_d9d.plans.expert_tensor import split_experts_over_tp

# tp splits attention and the dense layers; each tp rank routes its own positions; ep splits the experts.
_SUPPORTED = (*DATA_PARALLEL, "cp", "ep", "tp")


@dataclass
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    # Ours: a per-expert selection bias in every router (auxiliary-loss-free balancing, moved after each
    # optimizer step by lightning_d9d.callbacks.ExpertLoadBalancing). transformers' Qwen3-MoE has none.
    router_selection_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_bias: bool = False

    def __post_init__(self) -> None:
        check_decoder_shape(self)
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step ({self.decoder_sparse_step}) must be >= 1")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen3MoeConfig:
        """A small model for tests and CPU smoke runs: 3 layers, the middle one dense, 8 experts, top-2."""
        values: dict[str, Any] = dict(
            **TINY_SHAPE,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
        values.update(overrides)
        return cls(**values)

    # --------------------------------------------------------------------------------------- layers
    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds experts (transformers' rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_sparse(i)]

    @property
    def layer_aux_loss_coef(self) -> float:
        """Each sparse layer's load-balancing coefficient: the model's, shared over its sparse layers."""
        if not self.output_router_logits or not self.sparse_layers:
            return 0.0
        return self.router_aux_loss_coef / len(self.sparse_layers)

    @property
    def layer_z_loss_coef(self) -> float:
        return self.router_z_loss_coef / len(self.sparse_layers) if self.sparse_layers else 0.0

    # ----------------------------------------------------------------------------- Hugging Face config
    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments / ``config.json`` content for ``transformers.Qwen3MoeConfig``."""
        values = {
            key: value
            for key, value in self.__dict__.items()
            # ours only (transformers has neither): written when used
            if key not in ("router_z_loss_coef", "router_selection_bias") or value
        }
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **values,
            "mlp_only_layers": list(self.mlp_only_layers),
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_sliding_window": False,
        }

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any] | Any) -> Qwen3MoeConfig:
        """Read a ``config.json`` dict or a ``transformers.Qwen3MoeConfig``; refuse features this model lacks."""
        d: Mapping[str, Any] = hf.to_dict() if hasattr(hf, "to_dict") else hf
        return cls(
            **decoder_fields_from_hf(d, model_type="qwen3_moe", family="Qwen3-MoE"),
            # transformers 5 writes num_experts as num_local_experts (its attribute_map), 4.x as num_experts.
            num_experts=d.get("num_experts", d.get("num_local_experts", 128)),
            num_experts_per_tok=d.get("num_experts_per_tok", 8),
            moe_intermediate_size=d.get("moe_intermediate_size", 768),
            norm_topk_prob=d.get("norm_topk_prob", False),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            output_router_logits=d.get("output_router_logits", False),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
            router_z_loss_coef=d.get("router_z_loss_coef", 0.0),
            router_selection_bias=d.get("router_selection_bias", False),
        )

    def to_hf_config(self) -> Any:
        """A ``transformers.Qwen3MoeConfig`` (imports transformers, which is not a dependency of this package)."""
        import transformers

        kwargs = self.to_hf_dict()
        kwargs.pop("model_type")
        return transformers.Qwen3MoeConfig(**kwargs)

    # ------------------------------------------------------------------------------------------- sizes
    def num_params(self, *, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count from the shape. ``include_embedding=False`` leaves out the input embedding table (a
        lookup) but keeps the LM head; ``active=True`` counts only the ``num_experts_per_tok`` experts each token
        runs through (the router counts whole)."""
        h = self.hidden_size
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse_mlp = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size
        sparse = len(self.sparse_layers)
        mlps = sparse * sparse_mlp + (self.num_hidden_layers - sparse) * 3 * h * self.intermediate_size
        return decoder_params_without_mlps(self, include_embedding=include_embedding) + mlps


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's decoder layer with an :class:`MoE` block as ``mlp`` on sparse layers (the dense SwiGLU on the
    others)."""

    def __init__(self, config: Qwen3MoeConfig, layer: int) -> None:
        super().__init__(config, moe_block(config) if config.is_sparse(layer) else None)


def moe_block(config: Qwen3MoeConfig) -> MoE:
    """A sparse layer's feed-forward: router, routed experts and router losses as ``config`` says."""
    return MoE(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        normalize_top_k=config.norm_topk_prob,
        selection_bias=config.router_selection_bias,
        aux_loss_coef=config.layer_aux_loss_coef,
        z_loss_coef=config.layer_z_loss_coef,
    )


class Qwen3MoeModel(Qwen3Model):
    r"""Qwen3's decoder (:class:`~lightning_d9d.models.qwen3.Qwen3Model`) of :class:`Qwen3MoeDecoderLayer`\ s."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__(config, lambda i: Qwen3MoeDecoderLayer(config, i))


class Qwen3MoeStage(DecoderStage):
    """One pipeline stage of :class:`Qwen3MoeForCausalLM` (see :class:`~lightning_d9d.models.qwen3.DecoderStage`)."""

    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None:
        """The model's plan for one pipeline stage (tensor parallelism, experts over ep, then the sequence split
        over cp, then activation checkpointing, compile and data parallelism per decoder layer); each stage its
        own FSDP root. Between stages travel this rank's sequence parts."""
        require_degrees(dims, supported=("pp", *_SUPPORTED), owner="Qwen3MoeStage")
        # float8 linears first: the tp plan gives them torchao's float8 styles
        convert_blocks_to_float8([self.layers], dims, options)
        self.split_over_tp(dims)
        parallelize_expert(self, dims, options)
        split_experts_over_tp(self, dims, options)
        route_on_sequence_shards(self, dims, options)
        split_sequences(self, dims, options)
        parallelize_blocks(self, [self.layers], dims, options, preserve_rng_state=False)


def split_sequences(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """Under cp > 1: context-parallel attention and RoPE positions (:func:`~lightning_d9d.plans.
    parallelize_context`). Under cp or tp > 1: every MoE block's load-balancing loss counting the tokens of the
    whole sequences (the ``sequence`` view: the cp x tp ranks, each holding some of every sequence's
    positions when it routes). Before the layers are wrapped (checkpointing, compile)."""
    if dims.cp_enabled:
        parallelize_context(module, dims.mesh_for("cp"), options.context_attention, tp=dims.tp)
    if dims.cp_enabled or dims.tp_enabled:
        group = dims.mesh_for("sequence").get_group()
        for block in module.modules():
            if isinstance(block, MoE):
                block.sequence_group = group


def _normal_weights(module: nn.Module) -> list[torch.Tensor]:
    """Linear, embedding, router and routed-expert weights: N(0, initializer_range), as in transformers."""
    if isinstance(module, (nn.Linear, nn.Embedding, TopKRouter)):
        return [module.weight]
    if isinstance(module, GroupedExperts):
        return [module.gate_up_proj, module.down_proj]
    if isinstance(module, ExpertFactors):  # LoRA's per-expert adapters: drawn too, then given their own start
        return list(module.parameters(recurse=False))
    return []


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE with its language-model head: ``input_ids [B, T] -> logits [B, T, vocab]``.

    Built under ``torch.device("meta")`` the model is left uninitialised: shard it (:meth:`parallelize`), then
    ``to_empty(device=...)`` and :meth:`init_weights`. Built anywhere else it initialises itself from
    ``torch.initial_seed()``. See the module docstring for how the router losses reach the gradient.
    """

    config: Qwen3MoeConfig

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self._build(config, lambda: Qwen3MoeModel(config))

    # ----------------------------------------------------------------------------------- router losses
    def moe_blocks(self) -> list[MoE]:
        """The sparse layers' MoE blocks this model (or pipeline part) holds, in layer order."""
        return [module for module in self.modules() if isinstance(module, MoE)]

    def set_router_loss_scale(self, scale: float) -> None:
        """The factor the user's loss is multiplied by before backward (``1 / accumulation steps`` ...): the
        router losses' gradient is scaled alike, so that they count once per optimizer step as the loss does."""
        for block in self.moe_blocks():
            block.aux_loss_scale = scale

    def router_loss(self) -> torch.Tensor | None:
        """The weighted router losses of the last training forward (detached, for logging; already in the
        gradient), or ``None`` when they are off or no training forward ran."""
        values = [block.last_router_loss for block in self.moe_blocks() if block.last_router_loss is not None]
        return torch.stack(values).sum() if values else None

    # ---------------------------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter from ``(seed, its name)`` (sharding-invariant: see
        :mod:`lightning_d9d.modules.init`), zero the routers' load counters and selection biases, and
        recompute the RoPE tables. Linear, embedding, router and expert weights ~ N(0, initializer_range) as in
        transformers, norm weights = 1, biases = 0."""
        for router in routers_in(self):
            router.expert_load.zero_()
            if router.expert_bias is not None:
                router.expert_bias.zero_()
        init_decoder_weights_(self, self.config.initializer_range, seed, _normal_weights)

    # ----------------------------------------------------------------------------------------- parallel
    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None:
        """In order: tensor parallelism over ``tp`` (:func:`~lightning_d9d.models.qwen3.split_model_over_tp`:
        attention, dense layers, embedding and head as Qwen3's, the MoE blocks on this rank's positions; sizes
        tp does not divide refused before any collective), experts split over ``ep``
        (:func:`~lightning_d9d.plans.parallelize_expert`: all-to-all dispatch, expert weights sharded over ep
        and FSDP over the remaining data ranks), or with ``options.expert_tensor_parallel`` each expert split over
        tp (:func:`~lightning_d9d.plans.expert_tensor.split_experts_over_tp`: the tp group's routed tokens gathered
        to the shards, the partial outputs reduce-scattered), the MoE blocks' gradients summed over tp
        (:func:`~lightning_d9d.plans.route_on_sequence_shards`), context parallelism over ``cp``
        (:func:`split_sequences`: load-balanced sequence parts, all-gather attention, RoPE at the global
        positions, the load-balancing loss counted over the cp x tp ranks), then activation checkpointing,
        per-layer ``torch.compile``, and FSDP/HSDP per decoder layer plus the root (embedding, final norm,
        head; FSDP over ``dp_shard * cp``)."""
        require_degrees(
            dims,
            supported=_SUPPORTED,
            owner="Qwen3MoeForCausalLM",
            alternatives={
                "pp": "call Qwen3MoeStage.parallelize on each pipeline stage (the d9d strategy does)",
            },
        )
        # float8 linears first: the tp plan gives them torchao's float8 styles
        convert_blocks_to_float8([self.model.layers], dims, options)
        split_model_over_tp(self, dims)
        parallelize_expert(self, dims, options)
        split_experts_over_tp(self, dims, options)
        route_on_sequence_shards(self, dims, options)
        split_sequences(self, dims, options)
        # No dropout and no random routing: recompute needs no saved RNG state.
        parallelize_blocks(self, [self.model.layers], dims, options, preserve_rng_state=False)

    # ------------------------------------------------------------------------------------------ pipeline
    # (num_pipeline_layers and pipeline_keep: CausalLM)
    def pipeline_stage(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> Qwen3MoeStage:
        return Qwen3MoeStage(self, layer_ids, first=first, last=last)

    # ------------------------------------------------------------------------------------------- flops
    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), every weight trained: ``6 * N_active + 12 * L * H *
        head_dim * T`` (:mod:`lightning_d9d.models.flops`), with ``N_active`` the parameters a token runs through
        (its ``num_experts_per_tok`` experts, the whole router, no input embedding, the head even when tied), from
        the config."""
        c = self.config
        n = c.num_params(include_embedding=False, active=True)
        attention = AttentionShape(c.num_hidden_layers, c.num_attention_heads, c.head_dim)
        return training_flops_per_token(FlopParams(trained=n), attention, seq_len)
