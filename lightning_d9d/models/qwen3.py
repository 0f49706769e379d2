"""Qwen3 dense decoder: config, blocks, model, initialisation and parallel plan in one file. The decoder layer,
the model, the config's shared fields and the initialisation serve Qwen3-MoE too (:mod:`.qwen3_moe` passes its
MoE block as a sparse layer's ``mlp``).

Parameter names are those of Hugging Face's ``Qwen3ForCausalLM``, so its state dicts load 1:1::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight            (the same Parameter as embed_tokens.weight when tie_word_embeddings)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.causal_lm import CausalLM, CausalLMStage
from lightning_d9d.models.flops import AttentionShape, FlopParams, training_flops_per_token
from lightning_d9d.modules import (
    Attention,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    init_param_,
    normal_fill,
    ones_fill,
    zeros_fill,
)
from lightning_d9d.modules.attention import DocumentMask, document_attention_mask
from lightning_d9d.modules.autocast import to_autocast_dtype
from lightning_d9d.modules.context_attention import LoadBalancedSplit, gather_positions
from lightning_d9d.modules.documents import document_causal_mask, document_ids
from lightning_d9d.modules.init import Fill
from lightning_d9d.modules.moe import MoE
from lightning_d9d.plans import (
    DATA_PARALLEL,
    ParallelOptions,
    check_sequence_length,
    check_tensor_parallel_sizes,
    column_parallel,
    convert_blocks_to_float8,
    gather_sequence,
    local_to_sequence_shard,
    parallelize_blocks,
    parallelize_context,
    parallelize_tensor,
    per_head_norm,
    require_degrees,
    row_parallel_to_sequence,
    sequence_parallel_norm,
    vocab_parallel_embedding,
    vocab_parallel_head,
)

# The tiny presets' shape (Qwen3's and Qwen3-MoE's): a few hundred thousand parameters.
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_bias: bool = False

    def __post_init__(self) -> None:
        check_decoder_shape(self)

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen3Config:
        """A few-hundred-thousand-parameter model for tests and CPU smoke runs."""
        values: dict[str, Any] = {**TINY_SHAPE, "num_hidden_layers": 2, "tie_word_embeddings": False}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def qwen3_0_6b(cls, **overrides: Any) -> Qwen3Config:
        """The shape of ``Qwen/Qwen3-0.6B``: 0.60B parameters, of which 0.44B in the decoder layers."""
        values: dict[str, Any] = dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
        )
        values.update(overrides)
        return cls(**values)

    # ----------------------------------------------------------------------------- Hugging Face config
    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments / ``config.json`` content for ``transformers.Qwen3Config``.

        ``rope_theta`` is written at top level: transformers 4.x reads it there and 5.x converts it into
        ``rope_parameters``.
        """
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **asdict(self),
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_sliding_window": False,
        }

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any] | Any) -> Qwen3Config:
        """Read a ``config.json`` dict or a ``transformers.Qwen3Config``; refuse features this model lacks."""
        return cls(**decoder_fields_from_hf(hf, model_type="qwen3", family="Qwen3"))

    def to_hf_config(self) -> Any:
        """A ``transformers.Qwen3Config`` (imports transformers, which is not a dependency of this package)."""
        import transformers

        kwargs = self.to_hf_dict()
        kwargs.pop("model_type")
        return transformers.Qwen3Config(**kwargs)

    # ------------------------------------------------------------------------------------------- sizes
    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count computed from the shape (no module needed, so it works for meta/sharded models).

        ``include_embedding=False`` leaves out the input embedding table but keeps the LM head, tied or not:
        the head is a real matmul, the embedding a lookup.
        """
        mlps = self.num_hidden_layers * 3 * self.hidden_size * self.intermediate_size
        return decoder_params_without_mlps(self, include_embedding=include_embedding) + mlps


class DecoderShape(Protocol):
    """The config fields one decoder definition reads (:class:`Qwen3Config`, and Qwen3-MoE's, which adds the
    experts)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    attention_bias: bool


def check_decoder_shape(config: DecoderShape) -> None:
    """Refuse head counts grouped-query attention cannot share and a head size RoPE cannot rotate."""
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(
            f"num_key_value_heads ({config.num_key_value_heads}) must divide "
            f"num_attention_heads ({config.num_attention_heads})"
        )
    if config.head_dim % 2 != 0:
        raise ValueError(f"head_dim ({config.head_dim}) must be even for RoPE")


def decoder_fields_from_hf(hf: Mapping[str, Any] | Any, *, model_type: str, family: str) -> dict[str, Any]:
    """The :class:`DecoderShape` fields of a ``config.json`` dict or a ``transformers`` config of ``model_type``
    (the family's defaults where it leaves one out), after refusing what the decoder lacks (another activation,
    a sliding window, a RoPE scaling)."""
    d: Mapping[str, Any] = hf.to_dict() if hasattr(hf, "to_dict") else hf
    found = d.get("model_type", model_type)
    if found != model_type:
        raise ValueError(f"{family}: model_type is {found!r}, expected {model_type!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{family}: hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("use_sliding_window", False):
        raise NotImplementedError(f"{family}: use_sliding_window=True is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"{family}: rope_type={rope_type!r} is not supported (only 'default')")
    heads = d["num_attention_heads"]
    return {
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
        "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", d.get("rope_theta", 1e6))),
        "max_position_embeddings": d.get("max_position_embeddings", 40960),
        "tie_word_embeddings": d.get("tie_word_embeddings", False),
        "initializer_range": d.get("initializer_range", 0.02),
        "attention_bias": d.get("attention_bias", False),
    }


def decoder_params_without_mlps(config: DecoderShape, *, include_embedding: bool) -> int:
    """Every parameter but the layers' feed-forwards: attention and the two norms per layer, the final norm, the
    head (counted even when tied: a real matmul) and, with ``include_embedding`` and an untied head, the input
    embedding (a lookup)."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    attn = h * q_out + 2 * h * kv_out + q_out * h + 2 * d
    if config.attention_bias:
        attn += q_out + 2 * kv_out + h
    total = config.num_hidden_layers * (attn + 2 * h) + h + config.vocab_size * h
    if include_embedding and not config.tie_word_embeddings:
        total += config.vocab_size * h
    return total


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. ``mlp`` is the dense SwiGLU
    unless given (Qwen3-MoE gives its sparse layers an MoE block): one definition serves both models."""

    def __init__(self, config: DecoderShape, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qk_norm=True,
            norm_eps=config.rms_norm_eps,
            bias=config.attention_bias,
        )
        self.mlp = mlp if mlp is not None else SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_mask: DocumentMask | None = None
    ) -> torch.Tensor:
        if document_mask is None:  # a keyword only when given: tp's input styles see (x, cos, sin) alone
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, document_mask=document_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and final norm: ``input_ids [B, T] -> hidden states [B, T, hidden]``.

    ``layer(i)`` builds decoder layer ``i`` (default: :class:`Qwen3DecoderLayer`). ``layers`` is a ``ModuleDict``
    keyed by layer number, so that a pipeline stage can drop the layers it does
    not hold and keep the global names (``layers.5`` stays ``layers.5``). A stage without the embedding
    takes hidden states instead of ids; one without the final norm returns un-normalised hidden states.
    """

    def __init__(self, config: DecoderShape, layer: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        build = layer if layer is not None else (lambda _: Qwen3DecoderLayer(config))
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): build(i) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Into how many parts sequence parallelism cuts each sequence (tp; 1 without it): the residual stream
        # holds T / sequence_shards positions per rank, RoPE needs all T.
        self.sequence_shards = 1
        # Under context parallelism (set by parallelize_context): which positions of each sequence this rank
        # holds, so that RoPE rotates each token by its global position; the cp group, over which a packed
        # batch's positions are gathered for its document mask.
        self.context_split: LoadBalancedSplit | None = None
        self.context_group: dist.ProcessGroup | None = None
        # Head-parallel cp: each rank attends the whole sequence (some heads), so a packed batch's mask is whole.
        self.context_heads = False

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return run_decoder(
            self.embed_tokens,
            self.layers,
            self.norm,
            self.rotary_emb,
            input_ids,
            position_ids,
            sequence_shards=self.sequence_shards,
            context_split=self.context_split,
            context_group=self.context_group,
            context_heads=self.context_heads,
        )


def run_decoder(
    embed_tokens: nn.Module | None,
    layers: nn.ModuleDict,
    norm: nn.Module | None,
    rotary_emb: RotaryEmbedding,
    inputs: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    sequence_shards: int = 1,
    context_split: LoadBalancedSplit | None = None,
    context_group: dist.ProcessGroup | None = None,
    context_heads: bool = False,
) -> torch.Tensor:
    """Embed (when there is an embedding), run ``layers`` in order, normalise (when there is a norm).

    Under sequence parallelism (``sequence_shards`` > 1) token ids come in whole and hidden states as this
    rank's ``T / sequence_shards`` positions; the RoPE tables cover the whole sequence either way (attention
    gathers it). Under context parallelism (``context_split``) the rank holds its ``T / cp`` positions of each
    sequence and, unless ``position_ids`` are given, RoPE rotates them by their global positions.

    ``position_ids`` (a packed batch: restarting at 0 per document) make attention stay inside each document,
    through the mask built here once per forward and handed to every layer. Under cp they are this rank's part
    (``split_batch`` cut them with the ids): RoPE rotates by them as they are, and the mask of this rank's
    queries against every key comes from the whole rows' positions, all-gathered over ``context_group``; under
    head-parallel attention (``context_heads``) the whole rows' mask, as one process builds it.
    """
    if embed_tokens is not None:
        seq_len = inputs.shape[1]
        if sequence_shards > 1:
            check_sequence_length(seq_len, sequence_shards)
        x = to_autocast_dtype(embed_tokens(inputs))  # bf16 residual stream under autocast too
    else:
        x, seq_len = inputs, inputs.shape[1] * sequence_shards
    document_mask = None
    if position_ids is not None:  # packed rows: attention stays inside each document
        document_mask = packed_document_mask(
            position_ids, context_split, context_group, seq_len, whole=context_heads
        )
    elif context_split is not None:
        position_ids = context_split.local_positions(seq_len, device=inputs.device)
    cos, sin = rotary_emb(position_ids, seq_len, x.dtype)
    for layer in layers.values():
        x = layer(x, cos, sin) if document_mask is None else layer(x, cos, sin, document_mask=document_mask)
    return norm(x) if norm is not None else x


def packed_document_mask(
    position_ids: torch.Tensor,
    context_split: LoadBalancedSplit | None,
    context_group: dist.ProcessGroup | None,
    seq_len: int,
    *,
    whole: bool = False,
) -> DocumentMask:
    """A packed batch's document mask, once per forward: FlexAttention's block mask or the dense ``[B, 1, T, T]``
    one (:func:`~lightning_d9d.modules.attention.document_attention_mask`); under cp the dense rows of this rank's
    ``T / cp`` queries (``seq_len`` of them) against all ``T`` keys: the rows of the whole batch's mask that one
    process builds, so the documents are those one process sees (numbered over the whole row, gathered
    positions). ``whole``: under cp the whole rows' mask of any kind, as one process builds it (head-parallel
    attention attends every query)."""
    if context_split is None:
        return document_attention_mask(position_ids)
    if context_group is None:
        raise ValueError(
            "packed position_ids under context parallelism need the cp group to gather every rank's positions "
            "(context_group is None): parallelize the model with parallelize_context, which sets it"
        )
    rows = gather_positions(position_ids, context_split, context_group)  # [B, T]: a few bytes per token
    if whole:
        return document_attention_mask(rows)
    queries = context_split.local_positions(seq_len, device=position_ids.device)
    return document_causal_mask(document_ids(rows), queries)


class DecoderParts(Protocol):
    """What :func:`tensor_plan` reads of a decoder (a whole model's or one pipeline stage's)."""

    embed_tokens: nn.Embedding | None
    layers: nn.ModuleDict
    norm: RMSNorm | None


class SplitSizes(Protocol):
    """The sizes of a Qwen3-family config that tensor parallelism splits (Qwen3-MoE's experts are not split)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


def tensor_parallel_sizes(config: SplitSizes) -> dict[str, int]:
    """The sizes tensor parallelism splits, each of which tp must divide."""
    return {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }


def tensor_plan(
    decoder: DecoderParts, lm_head: nn.Module | None, *, prefix: str = ""
) -> dict[str, ParallelStyle]:
    """Qwen3's tensor-parallel plan for the parts ``decoder`` (and ``lm_head``) hold, keyed by module name
    relative to the module that owns ``decoder`` under ``prefix``.

    Attention: q/k/v split by heads (column-parallel), o row-parallel; the q/k norms act per head on this
    rank's heads. MLP: gate/up column-parallel, down row-parallel. Norms and residuals sequence-parallel; the
    embedding vocabulary-parallel; the head leaves vocabulary-sharded logits for the loss. An MoE block (the
    sparse layers of Qwen3-MoE, whose attention and dense layers are Qwen3's) runs on this rank's positions
    with whole weights (:func:`~lightning_d9d.plans.local_to_sequence_shard`; its gradients summed over tp by
    :func:`~lightning_d9d.plans.route_on_sequence_shards`): ep, not tp, splits its experts.
    """
    plan: dict[str, ParallelStyle] = {}
    if decoder.embed_tokens is not None:
        plan[f"{prefix}embed_tokens"] = vocab_parallel_embedding()
    for key, layer in decoder.layers.items():
        at = f"{prefix}layers.{key}."
        plan[f"{at}input_layernorm"] = sequence_parallel_norm()
        plan[f"{at}self_attn"] = gather_sequence(other_args=2)  # (x, cos, sin)
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{at}self_attn.{name}"] = column_parallel()
        plan[f"{at}self_attn.o_proj"] = row_parallel_to_sequence()
        attention = layer.self_attn
        if isinstance(attention, Attention) and attention.q_norm is not None:
            plan[f"{at}self_attn.q_norm"] = per_head_norm()
        if isinstance(attention, Attention) and attention.k_norm is not None:
            plan[f"{at}self_attn.k_norm"] = per_head_norm()
        plan[f"{at}post_attention_layernorm"] = sequence_parallel_norm()
        if isinstance(layer.mlp, MoE):
            plan[f"{at}mlp"] = local_to_sequence_shard()
            continue
        plan[f"{at}mlp"] = gather_sequence()
        for name in ("gate_proj", "up_proj"):
            plan[f"{at}mlp.{name}"] = column_parallel()
        plan[f"{at}mlp.down_proj"] = row_parallel_to_sequence()
    if decoder.norm is not None:
        plan[f"{prefix}norm"] = sequence_parallel_norm()
    if lm_head is not None:
        plan["lm_head"] = vocab_parallel_head()
    return plan


class _Decoder(DecoderParts, Protocol):
    rotary_emb: RotaryEmbedding
    sequence_shards: int


class _DecoderConfig(SplitSizes, Protocol):
    @property
    def tie_word_embeddings(self) -> bool: ...


class DecoderLM(Protocol):
    """What :class:`DecoderStage` and :func:`split_model_over_tp` read of a whole Qwen3-family model."""

    @property
    def model(self) -> _Decoder: ...

    @property
    def lm_head(self) -> nn.Linear | None: ...

    @property
    def config(self) -> _DecoderConfig: ...


def split_model_over_tp(model: DecoderLM, dims: ParallelDims) -> None:
    """Under tp > 1: the whole model's tensor plan (:func:`tensor_plan`), after refusing by name the sizes tp
    does not divide (before any collective); the decoder then hands out sequence shards."""
    if not dims.tp_enabled:
        return
    assert isinstance(model, nn.Module)
    check_tensor_parallel_sizes(dims.tp, type(model).__name__, tensor_parallel_sizes(model.config))
    parallelize_tensor(model, dims.mesh_for("tp"), tensor_plan(model.model, model.lm_head, prefix="model."))
    model.model.sequence_shards = dims.tp


class DecoderStage(CausalLMStage):
    """One pipeline stage of a Qwen3-family decoder: a few decoder layers, plus the embedding on the first
    stage and the final norm and LM head on the last. It shares its submodules with the (trimmed) whole model,
    which owns the parameters under their global names; this module is what the schedule runs. Each model's
    stage adds its ``parallelize``."""

    def __init__(self, model: DecoderLM, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        decoder = model.model
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layer_ids})
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        # Not a submodule: the RoPE tables belong to the model (and its init), the stage only reads them.
        self._rotary = [decoder.rotary_emb]
        self._config = model.config
        self.sequence_shards = 1  # as the model's: hidden states between stages hold T / tp positions
        self.context_split: LoadBalancedSplit | None = None  # as the model's: set by parallelize_context
        self.context_group: dist.ProcessGroup | None = None
        self.context_heads = False

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        ignore_index: int = -100,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states; on the last stage logits, or with ``labels`` their loss (see :class:`CausalLMStage`).
        Ids on the first stage, ``[B, T / (cp * tp), hidden]`` states after it. ``position_ids``: a packed
        microbatch's ``[B, T / cp]`` positions, handed to every stage (each builds its layers' document mask)."""
        hidden = run_decoder(
            self.embed_tokens,
            self.layers,
            self.norm,
            self._rotary[0],
            inputs,
            position_ids,
            sequence_shards=self.sequence_shards,
            context_split=self.context_split,
            context_group=self.context_group,
            context_heads=self.context_heads,
        )
        return self.head(hidden, labels, ignore_index)

    def split_over_tp(self, dims: ParallelDims) -> None:
        """Under tp > 1: the stage's part of the model's tensor plan (:func:`tensor_plan`), after refusing by
        name the sizes tp does not divide and a tied embedding whose head is on another stage."""
        if not dims.tp_enabled:
            return
        owner = type(self).__name__
        check_tensor_parallel_sizes(dims.tp, owner, tensor_parallel_sizes(self._config))
        if self._config.tie_word_embeddings and (self.embed_tokens is None) != (self.lm_head is None):
            raise NotImplementedError(
                f"{owner}: tie_word_embeddings=True with tp > 1 needs the embedding and the head in one "
                "stage (each stage is sharded on its own); set tie_word_embeddings=False, or tp=1"
            )
        parallelize_tensor(self, dims.mesh_for("tp"), tensor_plan(self, self.lm_head))
        self.sequence_shards = dims.tp


class Qwen3Stage(DecoderStage):
    """One pipeline stage of :class:`Qwen3ForCausalLM` (see :class:`DecoderStage`)."""

    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None:
        """The model's plan for one pipeline stage (tensor parallelism as the whole model's, then the block
        plan): each stage is its own FSDP root. Between stages travel this rank's sequence shards."""
        require_degrees(dims, supported=("pp", *DATA_PARALLEL, "cp", "tp"), owner="Qwen3Stage")
        # float8 linears first: the tp plan gives them torchao's float8 styles
        convert_blocks_to_float8([self.layers], dims, options)
        self.split_over_tp(dims)
        if dims.cp_enabled:
            parallelize_context(self, dims.mesh_for("cp"), options.context_attention, tp=dims.tp)
        # Before the layers are wrapped: TP and CP (above). No dropout in the layers: no RNG state to keep.
        parallelize_blocks(self, [self.layers], dims, options, preserve_rng_state=False)


def _linear_weights(module: nn.Module) -> list[torch.Tensor]:
    return [module.weight] if isinstance(module, (nn.Linear, nn.Embedding)) else []


@torch.no_grad()
def init_decoder_weights_(
    model: nn.Module,
    std: float,
    seed: int | None = None,
    normal_weights: Callable[[nn.Module], list[torch.Tensor]] = _linear_weights,
) -> None:
    """Initialise every parameter of ``model`` (a causal LM over :class:`Qwen3Model`) from ``(seed, its name)``
    and recompute the RoPE tables: the weights ``normal_weights`` names for each module ~ N(0, ``std``) (linear
    and embedding weights by default), norm weights = 1, biases = 0; a parameter none of these covers is
    refused by name. Each tensor is drawn whole on CPU in fp32 and sharded locally
    (:mod:`lightning_d9d.modules.init`), so the result is bitwise the same whatever the sharding, the device or
    the wrappers; a tied embedding is one Parameter, drawn once under ``model.embed_tokens.weight``."""
    seed = torch.initial_seed() if seed is None else seed
    normal = normal_fill(std)
    fills: dict[int, Fill] = {}
    for module in model.modules():
        for weight in normal_weights(module):
            fills[id(weight)] = normal
        if isinstance(module, RMSNorm):
            fills[id(module.weight)] = ones_fill
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            fills[id(bias)] = zeros_fill
    for name, param in sorted(model.named_parameters()):
        fill = fills.get(id(param))
        if fill is None:
            raise RuntimeError(f"{type(model).__name__}.init_weights: no initialiser for parameter {name!r}")
        init_param_(param, name, seed, fill)
    decoder: Any = model.get_submodule("model")
    decoder.rotary_emb.reset_parameters()


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 with its language-model head: ``input_ids [B, T] -> logits [B, T, vocab]``.

    Built under ``torch.device("meta")`` the model is left uninitialised: shard it (:meth:`parallelize`),
    then ``to_empty(device=...)`` and :meth:`init_weights`. Built anywhere else it initialises itself from
    ``torch.initial_seed()``.
    """

    config: Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self._build(config, lambda: Qwen3Model(config))

    # ---------------------------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter from ``(seed, its name)`` and recompute the RoPE tables.

        Linear and embedding weights ~ N(0, initializer_range), norm weights = 1, biases = 0. Each tensor is
        drawn whole on CPU in fp32 and sharded locally (see :mod:`lightning_d9d.modules.init`), so the result
        is bitwise the same whatever the sharding, the device, or the wrappers around the layers. A tied
        embedding is one Parameter and is drawn once, under the name ``model.embed_tokens.weight``.
        """
        init_decoder_weights_(self, self.config.initializer_range, seed)

    # ----------------------------------------------------------------------------------------- parallel
    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None:
        """Apply the parallel plan in place: tensor + sequence parallelism over ``tp`` (:func:`tensor_plan`),
        context parallelism over ``cp`` (:func:`~lightning_d9d.plans.parallelize_context`: load-balanced
        sequence chunks, all-gather attention, RoPE at the global positions; EP: not yet), activation
        checkpointing, per-layer ``torch.compile``, then FSDP/HSDP per decoder layer plus the root (2-D with
        tp: FSDP shards the tp shards over the ``fsdp`` mesh, which is ``dp_shard * cp``).

        Sizes that tp does not divide are refused here, before any collective.

        The root FSDP unit holds the embedding, final norm and LM head; with tied embeddings embedding and
        head share one Parameter, which FSDP2 shards once and all-gathers once per root unit.
        """
        require_degrees(
            dims,
            supported=(*DATA_PARALLEL, "cp", "tp"),
            owner="Qwen3ForCausalLM",
            alternatives={"pp": "call Qwen3Stage.parallelize on each pipeline stage (the d9d strategy does)"},
        )
        # float8 linears first: the tp plan gives them torchao's float8 styles
        convert_blocks_to_float8([self.model.layers], dims, options)
        split_model_over_tp(self, dims)
        if dims.cp_enabled:
            parallelize_context(self, dims.mesh_for("cp"), options.context_attention, tp=dims.tp)
        # Before the layers are wrapped: TP and CP (above). The decoder layers have no dropout (Qwen3's
        # attention_dropout is 0), so activation checkpointing need not save and restore the RNG state.
        parallelize_blocks(self, [self.model.layers], dims, options, preserve_rng_state=False)

    # ------------------------------------------------------------------------------------------ pipeline
    # (num_pipeline_layers and pipeline_keep: CausalLM)
    def pipeline_stage(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> Qwen3Stage:
        return Qwen3Stage(self, layer_ids, first=first, last=last)

    # ------------------------------------------------------------------------------------------- flops
    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) for sequences of ``seq_len`` tokens, every weight
        trained: ``6 * N + 12 * L * H * head_dim * T`` (:mod:`lightning_d9d.models.flops`), where ``N`` is the
        parameter count without the input embedding (a lookup, not a matmul) but with the LM head (counted even
        when tied), from the config, so any pipeline stage gives the whole model's count.
        """
        c = self.config
        n = c.num_params(include_embedding=False)
        attention = AttentionShape(c.num_hidden_layers, c.num_attention_heads, c.head_dim)
        return training_flops_per_token(FlopParams(trained=n), attention, seq_len)
