"""Pipeline stages of a ``transformers`` causal LM, carved where its own pp plan says.

``transformers`` ships the cut in every decoder's config: ``config.base_model_pp_plan`` names the base model's
parts in order with their inputs and outputs (``embed_tokens``: ``input_ids`` -> ``inputs_embeds``; ``layers``:
``hidden_states`` -> ``hidden_states``; ``norm``), and the causal LM class's ``_pp_plan`` the head (``lm_head``).
:class:`TransformersPipeline` reads them and implements :class:`~lightning_d9d.pipeline.PipelineSplittable`
for the model, as our own models do:

- ``pipeline_keep`` drops, in place, the layers this rank does not hold (their slots in the ``ModuleList``
  become ``None``, so every kept parameter keeps its global name: ``model.layers.5.mlp.up_proj.weight``), and the
  embedding / the norm and head unless this rank holds the first / last stage;
- each stage (:class:`TransformersStage`) runs **the base model's own forward** over its slice of layers: a
  shallow copy of the base model that holds only this stage's modules (the embedding on the first stage, the
  final norm on the last, an identity in its place before) and a copy of the config whose ``layer_types`` are
  this stage's. So the causal mask, the positions and rotary tables, and whatever a family hands its layers
  are computed by the family's code, as in an unsplit forward; the first stage passes ``input_ids``, the later
  ones the previous stage's hidden states as ``inputs_embeds`` (the plan's names). The last stage applies the
  head and then what the causal LM's forward does to its output, read from that forward
  (:func:`~.loss.logit_steps`: Gemma 2's soft cap, Granite's and Cohere's scales): its output is the logits,
  which the strategy's ``model_loss`` hands to the loss (on logits: the stages take no labels, so the fused
  head, which a soft-capped or scaled head does not take anyway, never runs under pp).

Refused before any collective (:func:`check_hf_pipeline_model`): a config without ``base_model_pp_plan`` or a
head without ``_pp_plan``, a plan whose parts are not the embedding, one ``ModuleList`` of layers and the norms,
a head that is not ``head(last hidden states)`` followed by steps the last stage can repeat (a head bias, a step
:func:`~.loss.logit_steps` does not read), and
``output_router_logits=True`` (the load-balancing loss needs every layer's router logits, which no stage
returns). Tied embeddings are refused by the strategy's pipeline check (the two ends sit on different ranks).

Under tp each stage is split by the model's tp plan on its own (:func:`~.tensor.hf_tensor_plan` on the stage):
between stages travel this rank's sequence shards, and a later stage first gathers them (the decoder builds its
mask and positions from the whole sequence), an all-gather per stage and microbatch that our own models avoid
by building positions from shards.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf.config_plans import config_pp_plan, head_pp_plan, head_tp_plan, moe_blocks
from lightning_d9d.models.hf.expert import offer_experts_to_float8, parallelize_hf_experts
from lightning_d9d.models.hf.kernels import swap_hf_kernels
from lightning_d9d.models.hf.loss import LogitSteps, forward_tree, logit_changes, logit_steps
from lightning_d9d.models.hf.tensor import (
    HiddenStatesLayout,
    check_tensor_parallel_model,
    hf_tensor_plan,
    localize_head_counts,
    split_modules,
)
from lightning_d9d.modules.hf_init import is_transformers_model
from lightning_d9d.plans import (
    DATA_PARALLEL,
    ParallelOptions,
    convert_blocks_to_float8,
    parallelize_blocks,
    parallelize_tensor,
    sum_gradients_over_tp,
)
from lightning_d9d.plans.degrees import require_degrees
from lightning_d9d.plans.tensor import SEQUENCE_DIM

# The base model's parts a pp plan names, in order (their names in every family we know).
EMBEDDING, LAYERS, NORM = "embed_tokens", "layers", "norm"


def pipeline_parts(model: nn.Module) -> tuple[dict[str, tuple[list[str], list[str]]], str]:
    """The config's ``base_model_pp_plan`` (part -> input names, output names) and the head's attribute name
    (the class's ``_pp_plan``); refuses, naming the model and the field, what a stage cannot be carved from."""
    name = type(model).__name__
    config = model.config
    plan, head_plan = config_pp_plan(model), head_pp_plan(model)  # the config's, or ours for its family
    if not plan or not head_plan:
        missing = "base_model_pp_plan" if not plan else f"{name}._pp_plan (the head)"
        raise ValueError(
            f"{name}: pp > 1 needs a pipeline plan, but {missing} is missing ({type(config).__name__}); use "
            "pp=1, or give the config a base_model_pp_plan (embed_tokens / layers / norm with their input and "
            "output names)"
        )
    if list(plan) not in ([EMBEDDING, LAYERS], [EMBEDDING, LAYERS, NORM]) or len(head_plan) != 1:
        raise NotImplementedError(
            f"{name}: pp > 1: base_model_pp_plan {list(plan)} with head {list(head_plan)} is not the "
            f"{EMBEDDING} / {LAYERS} / {NORM} + head cut this adapter carves; use pp=1"
        )
    return plan, next(iter(head_plan))


def check_hf_pipeline_model(model: nn.Module) -> None:
    """Refuse, from the model alone (before any collective), a ``transformers`` model the adapter cannot cut
    into pipeline stages (see the module docstring)."""
    name = type(model).__name__
    _, head_name = pipeline_parts(model)
    base = _base(model)
    layers = getattr(base, LAYERS, None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(
            f"{name}: pp > 1: the base model's {LAYERS} is {type(layers).__name__}, not a ModuleList; use pp=1"
        )
    if getattr(model, head_name, None) is not None and logit_steps(model) is None:
        fields = ", ".join(f"{field}={value}" for field, value in logit_changes(model).items())
        why = f"its config sets {fields}" if fields else "a head with a bias, a step on the logits"
        raise NotImplementedError(
            f"{name}: pp > 1: its logits are not {head_name}(last hidden states) followed by steps the last "
            f"stage can repeat ({why}: see lightning_d9d.models.hf.loss.logit_steps); use pp=1"
        )
    embedding_steps(model, base)  # refuses a change of the embeddings a later stage would repeat
    if getattr(model.config, "output_router_logits", False):
        raise NotImplementedError(
            f"{name}: pp > 1 with output_router_logits=True: the load-balancing loss needs every layer's router "
            "logits, which the pipeline stages do not return; set config.output_router_logits=False or pp=1"
        )


# The names the base model's forward holds the residual stream under before its layers.
STREAM = ("inputs_embeds", "hidden_states")


def embedding_steps(model: nn.Module, base: nn.Module) -> dict[str, float]:
    """What the base model's forward does to the embeddings before its layers, whatever they came from, as
    attributes of the base model and the value that makes each step nothing (attribute -> value): a later stage,
    handed hidden states as ``inputs_embeds``, would repeat the step, so its copy of the decoder holds that value.
    Granite: ``inputs_embeds = inputs_embeds * self.embedding_multiplier`` (-> 1); StarCoder2:
    ``hidden_states = dropout(hidden_states, p=self.embedding_dropout, ...)`` (-> 0).

    Read from the forward's syntax tree: its statements before the layer loop, but the lookup under
    ``if inputs_embeds is None:``. Refused by name: any other change of the stream there (``hidden_states =
    hidden_states * normalizer``, as Gemma's forward did before its embedding scaled itself), such an attribute
    that the forward reads elsewhere too, or a forward whose source cannot be read."""
    name = type(model).__name__
    base_class: Any = type(base)  # cached per class
    function = forward_tree(base_class)
    if function is None:
        raise NotImplementedError(
            f"{name}: pp > 1: the source of {type(base).__name__}.forward cannot be read, so nothing shows "
            "what it does to the embeddings before its layers (a later stage would repeat it); use pp=1"
        )
    steps: dict[str, float] = {}
    for statement in function.body:
        if isinstance(statement, ast.For):  # the layer loop
            break
        if isinstance(statement, ast.If) and _tests_no_embeddings(statement.test):
            continue  # the lookup
        for node in ast.walk(statement):
            if not (isinstance(node, ast.Assign) and _assigns_stream(node)):
                continue
            if isinstance(node.value, ast.Name):
                continue  # hidden_states = inputs_embeds
            step = _undoable_step(node.value, base)
            if step is None or _reads(function, step[0]) != 1:
                raise NotImplementedError(
                    f"{name}: pp > 1: {type(base).__name__}.forward changes the embeddings before its layers "
                    f"({ast.unparse(node)}), which a later stage, handed hidden states, would repeat; use pp=1"
                )
            steps[step[0]] = step[1]
    return steps


def _tests_no_embeddings(test: ast.expr) -> bool:
    """``inputs_embeds is None``."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == STREAM[0]
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Is)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _assigns_stream(node: ast.Assign) -> bool:
    return any(isinstance(target, ast.Name) and target.id in STREAM for target in node.targets)


def _undoable_step(value: ast.expr, base: nn.Module) -> tuple[str, float] | None:
    """``(attribute, 1)`` for ``<stream> * self.<attribute>`` (or ``/``), ``(attribute, 0)`` for
    ``<...>.dropout(<stream>, p=self.<attribute>, ...)`` (or ``p`` by position), the attribute a number of
    ``base``; else None."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult | ast.Div):
        stream, attribute, neutral = value.left, value.right, 1.0
    elif (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute | ast.Name)
        and (value.func.attr if isinstance(value.func, ast.Attribute) else value.func.id) == "dropout"
        and value.args
    ):
        rate = [k.value for k in value.keywords if k.arg == "p"] or value.args[1:2]
        if not rate:
            return None
        stream, attribute, neutral = value.args[0], rate[0], 0.0
    else:
        return None
    if not (
        isinstance(stream, ast.Name)
        and stream.id in STREAM
        and isinstance(attribute, ast.Attribute)
        and isinstance(attribute.value, ast.Name)
        and attribute.value.id == "self"
    ):
        return None
    number = getattr(base, attribute.attr, None)
    if not isinstance(number, int | float) or isinstance(number, bool):
        return None
    return attribute.attr, neutral


def _reads(function: ast.AST, attribute: str) -> int:
    """How often ``function`` reads ``self.<attribute>``."""
    return sum(
        isinstance(node, ast.Attribute)
        and node.attr == attribute
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(function)
    )


def _base(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise NotImplementedError(
            f"{type(model).__name__}: pp > 1 needs a causal LM around a base model (its base_model_prefix); use pp=1"
        )
    return base


def hf_pipeline_for(module: nn.Module) -> TransformersPipeline | None:
    """The adapter's pipeline view of ``module`` if it is a ``transformers`` model, else ``None``."""
    return TransformersPipeline(module) if is_transformers_model(module) else None


class TransformersPipeline:
    """:class:`~lightning_d9d.pipeline.PipelineSplittable` for a ``transformers`` causal LM (``model``)."""

    def __init__(self, model: nn.Module) -> None:
        check_hf_pipeline_model(model)
        self.model = model
        self.plan, self.head_name = pipeline_parts(model)
        self.base = _base(model)
        self.embedding_steps = embedding_steps(model, self.base)
        # what the forward does to the head's output (a soft cap, a scale): the last stage repeats it
        self.logit_steps = logit_steps(model) if getattr(model, self.head_name, None) is not None else None

    @property
    def num_pipeline_layers(self) -> int:
        return len(getattr(self.base, LAYERS))

    def pipeline_keep(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        layers: nn.ModuleList = getattr(self.base, LAYERS)
        keep = set(layer_ids)
        for index in range(len(layers)):
            if index not in keep:
                layers[index] = None  # type: ignore[assignment]  # the slot stays: names stay global
        if not first:
            setattr(self.base, EMBEDDING, None)
        if not last:
            if NORM in self.plan:
                setattr(self.base, NORM, None)
            setattr(self.model, self.head_name, None)

    def pipeline_stage(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> TransformersStage:
        return TransformersStage(self, layer_ids, first=first, last=last)


def _stage_decoder(
    pipeline: TransformersPipeline, layer_ids: Sequence[int], first: bool, last: bool
) -> nn.Module:
    """A shallow copy of the base model holding this stage's modules only (see the module docstring)."""
    base = pipeline.base
    decoder = copy.copy(base)
    # The copy's own module table and hook tables: what is set or registered on it leaves the base model alone.
    for attribute, value in vars(base).items():
        if attribute.startswith("_") and isinstance(value, dict):
            setattr(decoder, attribute, type(value)(value))
    layers: nn.ModuleList = getattr(base, LAYERS)
    decoder._modules[LAYERS] = nn.ModuleList([layers[i] for i in layer_ids])
    if not first:
        decoder._modules[EMBEDDING] = None
        for attribute, neutral in pipeline.embedding_steps.items():  # the first stage's: x * 1 is x
            setattr(decoder, attribute, neutral)
    if not last and NORM in pipeline.plan:
        decoder._modules[NORM] = nn.Identity()
    config: Any = copy.copy(getattr(base, "config"))  # noqa: B009  (a transformers config, untyped here)
    types = getattr(config, "layer_types", None)
    if isinstance(types, Sequence) and len(types) == len(layers):
        config.layer_types = [types[i] for i in layer_ids]  # the decoder looks them up by loop index
    decoder.config = config
    return decoder


class TransformersStage(nn.Module):
    """One pipeline stage of a ``transformers`` causal LM: the base model's forward over a slice of its layers,
    plus the head on the last stage. It shares its modules with the (trimmed) model, which owns the parameters
    under their global names; this module is what the schedule runs.

    It reads like the causal LM to the adapter's tp and cp plans: ``config``, ``base_model_prefix``, the decoder
    under that name, ``base_model``, the input / output embeddings and the head's tp plan.
    """

    def __init__(
        self, pipeline: TransformersPipeline, layer_ids: Sequence[int], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        model = pipeline.model
        self.first, self.last = first, last
        self.config = model.config
        self.base_model_prefix = str(getattr(model, "base_model_prefix", "model") or "model")
        self.model_name = type(model).__name__
        self.head_name = pipeline.head_name
        self.head_tp_plan: Mapping[str, str] = head_tp_plan(model)
        embed_input, embed_output = pipeline.plan[EMBEDDING]
        # first stage: token ids by the embedding's input name; later ones: hidden states by its output name
        self.input_name = (embed_input if first else embed_output)[0]
        self.add_module(self.base_model_prefix, _stage_decoder(pipeline, layer_ids, first, last))
        self.add_module(self.head_name, getattr(model, self.head_name) if last else None)
        self.logit_steps: LogitSteps | None = pipeline.logit_steps if last else None
        self.gathers_sequence = False  # under tp: a later stage gathers its input's sequence shards first

    @property
    def base_model(self) -> nn.Module:
        return getattr(self, self.base_model_prefix)

    def get_input_embeddings(self) -> nn.Module | None:
        return getattr(self.base_model, EMBEDDING, None)

    def get_output_embeddings(self) -> nn.Module | None:
        return getattr(self, self.head_name)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Ids on the first stage, hidden states after it; hidden states out, logits from the last stage.

        ``position_ids`` (by keyword, the whole microbatch's ``[B, T]``; every stage gets them): packed rows'
        positions, restarting at 0 per document. The decoder then rotates by them and ``transformers`` builds its
        per-document mask from them, as in an unsplit forward (no cache: its packed-sequence check runs).
        ``None``: positions ``0 .. T - 1``, as before."""
        extra = {} if position_ids is None else {"position_ids": position_ids}
        output: Any = self.base_model(**{self.input_name: inputs}, use_cache=False, **extra)
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        head = self.get_output_embeddings()
        if head is None:
            return hidden
        logits = head(hidden)
        return self.logit_steps(logits) if self.logit_steps is not None else logits

    def parallelize(self, dims: ParallelDims, options: ParallelOptions) -> None:
        """The adapter's plan for one stage, in torchtitan's order: our kernels, tp from the model's tp plan, cp,
        ep, then recompute / compile / FSDP per decoder layer with the stage as its own FSDP root."""
        require_degrees(
            dims,
            supported=("pp", *DATA_PARALLEL, "tp", "cp", "ep"),
            owner=f"the transformers adapter's pipeline stage of {self.model_name}",
        )
        swap_hf_kernels(self)
        layers = getattr(self.base_model, LAYERS)
        offer_experts_to_float8(self, options)  # as parallelize_hf
        convert_blocks_to_float8([layers], dims, options)  # before tp, as parallelize_hf
        if dims.tp_enabled:
            check_tensor_parallel_model(self, dims.tp)
            parallelize_tensor(self, dims.mesh_for("tp"), hf_tensor_plan(self))
            localize_head_counts(self, split_modules(self), dims.tp)
            if not self.first:
                # the decoder builds its causal mask and positions from the whole sequence (see the docstring)
                HiddenStatesLayout(Shard(SEQUENCE_DIM), Replicate())._apply(self, dims.mesh_for("tp"))
                self.gathers_sequence = True
        if dims.cp_enabled:
            # the stage's forward takes position_ids (packed rows), which cp's own check would now let through
            raise NotImplementedError(
                f"{self.model_name}: pp={dims.pp} x cp={dims.cp} on a transformers model is not proven yet (its "
                "stages under context parallelism are untested); use pp=1 or cp=1"
            )
        parallelize_hf_experts(self, dims, options)
        sum_gradients_over_tp(moe_blocks(self).values(), dims, options)  # as parallelize_hf (tp only)
        parallelize_blocks(self, [layers], dims, options, moe=bool(moe_blocks(self)))
