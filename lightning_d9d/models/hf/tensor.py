"""Tensor + sequence + loss parallelism for a ``transformers`` model, read from its own tensor-parallel plan.

``transformers`` ships the plan in every model: ``config.base_model_tp_plan`` maps module-name patterns of the
base model (``"layers.*.self_attn.q_proj"``) to style names (``"colwise"``, ``"rowwise"``, ...), and the model
class's ``_tp_plan`` adds the head (``{"lm_head": "colwise_gather_output"}``). We translate those names onto
torch's ``ParallelStyle``s (:mod:`lightning_d9d.plans.tensor`) and add what ``transformers`` leaves out:

- sequence parallelism, where the decoder layers allow it (every part of a layer outside the split regions is
  a norm): the residual stream between the layers holds ``T / tp`` positions per rank; each region (attention,
  MLP: a parent of column/row-parallel projections) all-gathers the sequence at its input, its row-parallel
  output reduce-scatters it back, and the norms run on the sequence shards. The embedding output stays whole
  (the decoder builds its causal mask and positions from it) and the first layer cuts it into shards, a slice.
  Elsewhere the plan runs as ``transformers`` runs it: the residual stream replicated, row-parallel outputs
  all-reduced;
- the embedding split over the vocabulary (also when the plan does not name it), so a tied head stays tied; an
  embedding whose forward scales the lookup by an attribute of its own (Gemma's ``embed_scale``) scales the
  reduced rows alike (:mod:`.embedding`);
- loss parallelism: whatever the plan says for the head, it leaves its logits sharded on the vocabulary dim for
  torch's ``loss_parallel``: no rank holds ``[tokens, vocab]``.

MoE blocks (the parents of the experts modules the ep plan names) are not split: each runs on this rank's
sequence shard with its weights whole, and the caller sums their gradients over tp (:func:`split_modules` says
why). The styles with which ``transformers`` gathers a region's features (``colwise_gather_output`` /
``rowwise_split_input``: Phi-3's fused projections, OLMo 2's q/k/v) and MLA's latent projection
(``mla_kv_a_proj``) are split by heads (:mod:`.head_split`). A style this slice does not translate yet
(``local_colwise``, ...) is refused, naming the model class, the module and the style. ``transformers`` is never
imported here: the model is read through its attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_d9d.models.hf.config_plans import config_tp_plan, expand_plan, moe_blocks
from lightning_d9d.models.hf.embedding import VocabParallelWholeEmbedding, embedding_scale
from lightning_d9d.models.hf.head_split import (
    HEAD_SPLIT_STYLES,
    check_head_split,
    covered,
    head_split_plan,
    localize_config,
)
from lightning_d9d.models.hf.sinks import SINKS, HeadShardedSinks, sink_attention_plan, sink_attentions
from lightning_d9d.plans.fp8 import float8_input_cast
from lightning_d9d.plans.tensor import (
    SEQUENCE_DIM,
    check_sequence_length,
    check_tensor_parallel_sizes,
    column_parallel,
    per_head_norm,
    row_parallel_to_sequence,
    vocab_parallel_head,
)

# Plan style names (of every transformers version we support) that this adapter translates.
COLUMN = ("colwise",)
# rowwise_split_input: transformers slices a gathered input; under the head split it arrives as this rank's part
ROW = ("rowwise", "rowwise_split_input")
GATHERED_COLUMN = ("colwise_gather_output", "colwise_rep")  # for the LM head only
PER_HEAD_NORM = ("replicated_with_grad_allreduce",)
EMBEDDING = ("embedding_rowwise",)
KNOWN = (*COLUMN, *ROW, *GATHERED_COLUMN, *PER_HEAD_NORM, *EMBEDDING)
# Attention attributes some families read their view shapes from: per rank after the heads are split.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


# ------------------------------------------------------------------------------------------- the plan text
def _module_from(model: nn.Module, method: str) -> nn.Module | None:
    getter = getattr(model, method, None)
    found = getter() if callable(getter) else None
    return found if isinstance(found, nn.Module) else None


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The model's token embedding (``get_input_embeddings()``), if it has one."""
    return _module_from(model, "get_input_embeddings")


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's LM head (``get_output_embeddings()``), if it has one."""
    return _module_from(model, "get_output_embeddings")


def inner_split(model: nn.Module, split: Mapping[str, str]) -> dict[str, str]:
    """``split`` but the head and the input embedding: the decoder's split modules."""
    ends = (output_embedding(model), input_embedding(model))
    modules = dict(model.named_modules())
    return {name: style for name, style in split.items() if modules[name] not in ends}


def split_modules(model: nn.Module) -> dict[str, str]:
    """The modules tp splits: the plan's expanded entries (module name -> style) but those inside an MoE block.

    The plans of MoE configs split every expert's columns over tp (``packed_colwise`` / ``moe_tp_experts``), so
    every tp rank would route the whole sequence and all-reduce the experts' partial sums. We run each MoE block
    instead on this rank's sequence shard with its weights whole (as for our own MoE models,
    :mod:`lightning_d9d.plans.routing`): no rank repeats another's routing or expert work, the experts' GEMMs
    keep their full width, and under ep the dispatcher moves only this rank's tokens.
    """
    blocks = tuple(moe_blocks(model))
    planned = expand_plan(model, config_tp_plan(model))
    if planned:  # GPT-OSS's plan names its embedding only: its sink attentions' heads split too
        planned.update(sink_attention_plan(model, planned))
    return {
        name: style
        for name, style in planned.items()
        if not any(name == block or name.startswith(f"{block}.") for block in blocks)
    }


# ---------------------------------------------------------------------------------------------- checks
def check_tensor_parallel_model(model: nn.Module, tp: int) -> None:
    """Refuse, before any collective, a model that tp cannot split: no tp plan in its config, a style this
    adapter does not translate yet, or a size (heads, KV heads, MLP width, vocabulary) tp does not divide."""
    name = type(model).__name__
    config = model.config
    plan = config_tp_plan(model)
    if not plan:
        raise ValueError(
            f"{name}: tp={tp} needs a tensor-parallel plan, but its config ({type(config).__name__}) has no "
            "base_model_tp_plan; use tp=1, or give the config a base_model_tp_plan (module-name patterns -> "
            '"colwise" / "rowwise") or the model a parallelize(dims, options) method'
        )
    modules = dict(model.named_modules())
    ends = (output_embedding(model), input_embedding(model))
    split = split_modules(model)
    for module_name, style in split.items():
        inner = (*COLUMN, *ROW, *PER_HEAD_NORM, *HEAD_SPLIT_STYLES)
        translated = KNOWN if modules[module_name] in ends else inner
        if style not in translated:
            raise NotImplementedError(
                f"{name}: tp={tp}: the tp plan's style {style!r} (for {module_name}) is not translated yet; "
                f"translated: {', '.join(translated)}. Use tp=1"
            )
    embedding = ends[1]
    if isinstance(embedding, nn.Embedding) and embedding_scale(embedding) is None:
        raise NotImplementedError(
            f"{name}: tp={tp}: the input embedding {type(embedding).__name__} has a forward of its own, which the "
            "vocabulary-parallel lookup would replace (it repeats only a lookup times a scale of the module's, "
            "as Gemma's embeddings do); not translated yet. Use tp=1"
        )
    sizes = {
        field: getattr(config, field)
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
        if isinstance(getattr(config, field, None), int)
    }
    check_tensor_parallel_sizes(tp, name, sizes)
    # what the config does not say: every split module's own width
    for module_name, style in split.items():
        module = modules[module_name]
        if isinstance(module, nn.Linear) and style in (*COLUMN, *ROW, *GATHERED_COLUMN):
            field, size = (
                ("in_features", module.in_features) if style in ROW else ("out_features", module.out_features)
            )
            check_tensor_parallel_sizes(tp, name, {f"{module_name}.{field}": size})
    check_head_split(model, inner_split(model, split), tp)
    _check_regions_covered(model, split, tp)
    _check_moe_blocks(model, split, tp)


def _check_moe_blocks(model: nn.Module, split: Mapping[str, str], tp: int) -> None:
    """MoE blocks run on sequence shards (:func:`split_modules`): the decoder must allow sequence parallelism,
    and the load-balancing loss, computed from every layer's router logits, would see this rank's shard only."""
    blocks = moe_blocks(model)
    if not blocks:
        return
    name = type(model).__name__
    if sequence_parallel_layout(model, split) is None:
        raise NotImplementedError(
            f"{name}: tp={tp}: its MoE blocks ({next(iter(blocks))}, ...) run on each rank's sequence shard, but "
            "a part of its decoder layers is neither a norm, an MoE block nor a split attention/MLP, so the "
            f"residual stream cannot be sequence-sharded; use tp=1 (ep and the data degrees apply)"
        )
    if getattr(model.config, "output_router_logits", False):
        raise NotImplementedError(
            f"{name}: tp={tp} with output_router_logits=True: each tp rank routes its own sequence shard, so "
            "the load-balancing loss would count that shard's tokens only; set config.output_router_logits=False "
            "or use tp=1 (ep and the data degrees keep the model's own load-balancing loss)"
        )


def _check_regions_covered(model: nn.Module, split: Mapping[str, str], tp: int) -> None:
    """Inside a module whose projections are split (attention, MLP), a module with parameters the plan does not
    name would see this rank's heads or columns only while its weights stay whole: its gradient would hold only
    this rank's part, silently (older plans lack Qwen3's q/k norms, for one). Refuse it by name."""
    modules = dict(model.named_modules())
    regions = {
        module_name.rpartition(".")[0]
        for module_name, style in inner_split(model, split).items()
        if style in (*COLUMN, *ROW, *HEAD_SPLIT_STYLES)
    }
    accounted = covered(model, split)  # split with the heads, or whole by design (head_split)
    with_sinks = sink_attentions(model)  # their sinks split with the heads (HeadShardedSinks)
    for region in sorted(regions):
        for inner_name, inner in modules[region].named_modules(prefix=region):
            # a planned layer's own children (LoRA's adapters) are its style's to shard
            inside_planned = inner_name.rpartition(".")[0] in split
            if inner_name in accounted:
                continue
            own = [name for name, _ in inner.named_parameters(recurse=False)]
            if inner_name in with_sinks:
                own.remove(SINKS)
            if inner_name in split or inside_planned or not own:
                continue
            raise NotImplementedError(
                f"{type(model).__name__}: tp={tp}: {inner_name} ({type(inner).__name__}) sits among split "
                "projections but the config's tp plan does not name it, so its gradient would cover this rank's "
                "part only; add it to base_model_tp_plan (a norm over each head: "
                f'"replicated_with_grad_allreduce"), or use tp=1'
            )


# -------------------------------------------------------------------------------------------- styles
class HiddenStatesLayout(ParallelStyle):
    """Redistribute a module's hidden states (its first positional argument, or ``hidden_states=``, as
    ``transformers`` layers are called either way) from ``input_layout`` to ``desired_layout`` on the tp mesh,
    handing the module a plain tensor. ``check_length``: refuse a sequence tp does not divide, by name.

    ``float8``: cast the hidden states to float8 before the redistribution and hand the module the ``DTensor``
    (:meth:`in_float8`, which the FP8 plan asks for where every column-parallel linear of the module is a
    tensorwise float8 one: ``lightning_d9d.plans.fp8.float8_tensor_plan``): a region's sequence gather then moves
    float8, with one scale over the whole sequence, and its projections take the cast input as torchao's float8
    styles take ``PrepareFloat8ModuleInput``'s."""

    def __init__(
        self,
        input_layout: Placement,
        desired_layout: Placement,
        *,
        check_length: bool = False,
        float8: bool = False,
    ) -> None:
        super().__init__()
        self.input_layout, self.desired_layout, self.check_length = input_layout, desired_layout, check_length
        self.float8 = float8

    def in_float8(self) -> ParallelStyle:
        """This gather in float8; a layout that gathers nothing (a shard kept, a cut) stays as it is."""
        if not (isinstance(self.input_layout, Shard) and isinstance(self.desired_layout, Replicate)):
            return self
        return HiddenStatesLayout(
            self.input_layout, self.desired_layout, check_length=self.check_length, float8=True
        )

    def _convert(
        self, tensor: torch.Tensor, mesh: DeviceMesh, cast: Callable[[DTensor], DTensor] | None
    ) -> torch.Tensor:
        if self.check_length:
            check_sequence_length(tensor.shape[SEQUENCE_DIM], mesh.size())
        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, mesh, [self.input_layout], run_check=False)
        if cast is not None:  # torchao's float8 styles take the float8 DTensor as it is
            return cast(tensor).redistribute(mesh, [self.desired_layout])
        return tensor.redistribute(mesh, [self.desired_layout]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        cast = float8_input_cast(module) if self.float8 else None

        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            if args:
                return (self._convert(args[0], device_mesh, cast), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                hidden = self._convert(kwargs["hidden_states"], device_mesh, cast)
                return args, {**kwargs, "hidden_states": hidden}
            raise TypeError(f"{type(module).__name__} was called without hidden states to redistribute")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


# ------------------------------------------------------------------------------------------- structure
def _is_norm(module: nn.Module, hidden_size: int) -> bool:
    """A module whose parameters are all ``[hidden]`` vectors (an RMSNorm / LayerNorm over the hidden dim)."""
    params = list(module.parameters())
    return bool(params) and all(p.ndim == 1 and p.shape[0] == hidden_size for p in params)


class SequenceLayout(NamedTuple):
    """Where a decoder's residual stream is sequence-sharded (modules by name)."""

    layers: nn.ModuleList
    regions: list[str]  # children of a layer holding split projections: all-gather in, reduce-scatter out
    layer_norms: list[str]  # children of a layer that are norms: on the sequence shards
    token_local: list[str]  # children of a layer that are MoE blocks: on the sequence shards, weights whole
    final_norms: list[str]  # the decoder's own norms (after the layers): on the shards, a plain shard out


def sequence_parallel_layout(model: nn.Module, split: Mapping[str, str]) -> SequenceLayout | None:
    """Where the residual stream may be sequence-sharded, or ``None`` when some part of the decoder is neither
    a region, a norm nor an MoE block (SP then stays off).

    A region is a direct child of a decoder layer that holds split projections (attention, MLP); a norm is a
    module whose parameters are ``[hidden]`` vectors; an MoE block (:func:`~.config_plans.moe_blocks`) works
    token by token, so it runs on the shards like a norm. The decoder (the base model) may hold only the input
    embedding, the layers, norms after them and parameter-free modules (the rotary embedding).
    """
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    hidden = getattr(model.config, "hidden_size", None)
    if not isinstance(base, nn.Module) or not isinstance(hidden, int):
        return None
    at = f"{prefix}." if base is not model else ""
    embedding = input_embedding(model)
    layers: nn.ModuleList | None = None
    regions: list[str] = []
    layer_norms: list[str] = []
    token_local: list[str] = []
    final_norms: list[str] = []
    blocks = moe_blocks(model)
    for child_name, child in base.named_children():
        if child is embedding or not any(True for _ in child.parameters()):
            continue
        if _is_norm(child, hidden):
            if layers is None:
                return None  # a norm before the layers (on the embedding) would see the whole sequence
            final_norms.append(f"{at}{child_name}")
            continue
        if not isinstance(child, nn.ModuleList) or layers is not None:
            return None
        layers = child
        for index, layer in enumerate(child):
            for part_name, part in layer.named_children():
                name = f"{at}{child_name}.{index}.{part_name}"
                if not any(True for _ in part.parameters()):
                    continue
                if _is_norm(part, hidden):
                    layer_norms.append(name)
                elif name in blocks:
                    token_local.append(name)
                elif any(key.startswith(f"{name}.") and style in ROW for key, style in split.items()):
                    regions.append(name)
                else:
                    return None
    if layers is None or not regions:
        return None
    return SequenceLayout(layers, regions, layer_norms, token_local, final_norms)


# ---------------------------------------------------------------------------------------------- the plan
def hf_tensor_plan(model: nn.Module, *, sequence_parallel: bool | None = None) -> dict[str, ParallelStyle]:
    """The torch styles for ``model``'s own tp plan: module name -> style. ``sequence_parallel``: ``None`` where
    the model allows it (:func:`sequence_parallel_layout`), ``False`` never. Call
    :func:`check_tensor_parallel_model` first."""
    name = type(model).__name__
    split = split_modules(model)
    head, embedding = output_embedding(model), input_embedding(model)
    modules = dict(model.named_modules())
    names = {id(module): module_name for module_name, module in modules.items()}
    layout = sequence_parallel_layout(model, split) if sequence_parallel is not False else None
    sp = layout is not None
    plan: dict[str, ParallelStyle] = {}
    for module_name, style in split.items():
        module = modules[module_name]
        if module is head or module is embedding:
            continue  # below, whatever the plan says
        if style in COLUMN:
            plan[module_name] = column_parallel()
        elif style in ROW:
            plan[module_name] = row_parallel_to_sequence() if sp else RowwiseParallel()
        elif style in PER_HEAD_NORM:
            plan[module_name] = per_head_norm()
        elif style not in HEAD_SPLIT_STYLES:  # refused by check_tensor_parallel_model
            raise NotImplementedError(f"{name}: the tp plan's style {style!r} for {module_name}")
    # gathered columns and MLA's latent projections, split by heads; the norms over a gathered q/k/v's features
    plan.update(head_split_plan(model, inner_split(model, split)))
    if isinstance(embedding, nn.Embedding) and id(embedding) in names:
        plan[names[id(embedding)]] = VocabParallelWholeEmbedding()
    if isinstance(head, nn.Linear) and id(head) in names:
        plan[names[id(head)]] = (
            vocab_parallel_head() if sp else ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        )
    if layout is None:
        if moe_blocks(model):
            raise NotImplementedError(
                f"{name}: its MoE blocks run on each tp rank's sequence shard: sequence_parallel=False is not "
                "supported for an MoE model"
            )
        return _with_sharded_sinks(model, plan)
    for norm in [*layout.layer_norms, *layout.final_norms]:
        # a plain shard out: the next region takes either, but Gemma 2 / 3 add their post-attention and
        # post-feedforward norms' outputs to the residual stream (a plain shard), and the model slices the final
        # norm's output by logits_to_keep before the head (a DTensor would gather)
        plan[norm] = SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True)
    for region in layout.regions:
        plan[region] = HiddenStatesLayout(Shard(SEQUENCE_DIM), Replicate())
    for block in layout.token_local:  # the shard as a plain tensor; the caller sums its gradients over tp
        plan[block] = HiddenStatesLayout(Shard(SEQUENCE_DIM), Shard(SEQUENCE_DIM))
    plan[names[id(layout.layers[0])]] = HiddenStatesLayout(
        Replicate(), Shard(SEQUENCE_DIM), check_length=True
    )
    return _with_sharded_sinks(model, plan)


def _with_sharded_sinks(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Every sink attention whose projections the plan splits shards its sinks with its heads, before its own
    style (the region's sequence gather)."""
    for name in sink_attentions(model):
        if f"{name}.q_proj" in plan:
            plan[name] = HeadShardedSinks(plan.get(name))
    return plan


def localize_head_counts(model: nn.Module, split: Mapping[str, str], tp: int) -> None:
    """Attention modules whose q/k/v are split: the head counts some families keep as attributes (and read
    their view shapes from) become this rank's, and so do those a forward reads from its config (Phi-3:
    :func:`~.head_split.localize_config`). Qwen3 and Llama view with ``-1`` heads and need none."""
    modules = dict(model.named_modules())
    parents = {
        name.rpartition(".")[0]
        for name, style in inner_split(model, split).items()
        if style in (*COLUMN, *HEAD_SPLIT_STYLES)
    }
    for parent in parents:
        module = modules.get(parent)
        if module is not None:
            localize_config(module, tp)
        for attribute in HEAD_COUNTS:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attribute, value // tp)
