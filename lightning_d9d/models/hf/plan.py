"""The plan of a ``transformers`` model: tensor + sequence + loss parallelism from its own tp plan, then the
block tail every plan ends with (activation checkpointing, compile, FSDP per decoder layer plus the root).

The strategy asks :func:`hf_plan_for` which plan a module has; it knows no model family.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf.attention import causal_attention_without_mask_sync
from lightning_d9d.models.hf.config_plans import moe_blocks
from lightning_d9d.models.hf.context import check_hf_context_model, parallelize_hf_context
from lightning_d9d.models.hf.expert import (
    check_hf_expert_model,
    check_hf_expert_tensor_model,
    offer_experts_to_float8,
    parallelize_hf_experts,
)
from lightning_d9d.models.hf.kernels import swap_hf_kernels, unwrap_hub_kernel_forwards
from lightning_d9d.models.hf.routing import count_router_load
from lightning_d9d.models.hf.tensor import (
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
    repeated_blocks,
    require_degrees,
    sum_gradients_over_tp,
)

Plan = Callable[[ParallelDims, ParallelOptions], None]
# parallelize_hf plans a whole model: under pp the strategy cuts it first and plans each stage.
PIPELINE = (
    "let D9DStrategy(pp=...) cut the model into stages (lightning_d9d.models.hf.pipeline), each planned alike"
)


def hf_plan_for(module: nn.Module) -> Plan | None:
    """The adapter's plan for ``module`` if it is a ``transformers`` model (``plan(dims, options)``), else
    ``None`` (the strategy then takes the module's own ``parallelize`` or the default plan)."""
    if not is_transformers_model(module):
        return None
    return partial(parallelize_hf, module)


def check_hf_model(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None) -> None:
    """Everything the adapter refuses, from the degrees and the model's config alone (no process group is
    needed, so it runs before any collective): pp (the strategy cuts the model into stages first), for tp a
    missing plan, a style not translated yet, or a size tp does not divide, for cp and ep what
    :func:`~.context.check_hf_context_model` and :func:`~.expert.check_hf_expert_model` refuse, and with
    ``options.expert_tensor_parallel`` what :func:`~.expert.check_hf_expert_tensor_model` refuses."""
    name = type(model).__name__
    require_degrees(
        dims,
        supported=(*DATA_PARALLEL, "tp", "cp", "ep"),
        owner=f"the transformers adapter for {name}",
        alternatives={"pp": PIPELINE},
    )
    if dims.tp_enabled:
        check_tensor_parallel_model(model, dims.tp)
    if dims.cp_enabled:
        check_hf_context_model(model, dims.cp)
    if dims.ep_enabled:
        check_hf_expert_model(model, dims.ep)
    if options is not None and options.expert_tensor_parallel and dims.tp_enabled:
        check_hf_expert_tensor_model(model, dims.tp)


def parallelize_hf(
    model: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    sequence_parallel: bool | None = None,
) -> None:
    """Parallelize a ``transformers`` model in place, in torchtitan's order.

    1. Refuse what the adapter cannot do (:func:`check_hf_model`), before any collective.
    1b. Our kernels in place of matching modules' forwards (:func:`~.kernels.swap_hf_kernels`: the RMSNorms;
       ``$LIGHTNING_D9D_HF_KERNELS=0`` keeps ``transformers``' own); MoE routers count their experts' load
       (:func:`~.routing.count_router_load`; the selection bias where the user added it).
    1c. ``options.fp8``: the decoder layers' linears become torchao's float8 linears, before tp (whose plan then
       takes torchao's float8 styles for tensorwise ones, the regions' sequence gathers in float8 too); the
       experts take the float8 grouped GEMM where ``fp8_experts`` and the device allow it
       (:func:`~.expert.offer_experts_to_float8`).
    2. tp > 1: the model's own tp plan translated onto torch's styles (:func:`~.tensor.hf_tensor_plan`:
       sequence parallelism where the decoder allows it, the embedding split over the vocabulary, loss
       parallelism for the head; a tied head stays one Parameter), applied on the ``tp`` mesh.
    2b. cp > 1: our load-balanced context-parallel attention through ``transformers``' attention interface and
       ``position_ids`` by global position (:func:`~.context.parallelize_hf_context`). Otherwise a forward
       without a mask skips ``transformers``' mask preparation and its host sync
       (:func:`~.attention.causal_attention_without_mask_sync`).
    2c. ep > 1: the stacked experts split over ep, tokens brought by our dispatcher
       (:func:`~.expert.parallelize_hf_experts`; without ep our forward with a local dispatcher, where a probe of
       the class finds it exact). Under tp
       each MoE block routes this rank's sequence shard, its weights whole, its gradients summed over tp
       (:func:`~lightning_d9d.plans.sum_gradients_over_tp`); with ``options.expert_tensor_parallel`` each expert
       is split over tp instead (:func:`~.expert.split_hf_experts_over_tp`).
    3. In training no KV cache (:func:`train_without_cache`); under compile, no ``kernels`` routing wrapper
       around forwards (:func:`~.kernels.unwrap_hub_kernel_forwards`: it cannot compile inside recompute).
    4. Activation checkpointing and compile per decoder layer, then FSDP/HSDP per decoder layer plus the root
       (2-D with tp: FSDP shards the tp shards over ``fsdp``), as the default plan does.

    ``sequence_parallel``: ``None`` where the model allows it, ``False`` keeps the residual stream replicated
    (as ``transformers``' own tp runs).
    """
    check_hf_model(model, dims, options)
    swap_hf_kernels(model)  # before any plan: only forwards change, names and shapes stay
    count_router_load(model)  # MoE routers count their load for ExpertLoadBalancing (outputs unchanged)
    # float8 linears before tp (its plan gives them torchao's float8 styles), after the kernel swaps' probes; the
    # experts where fp8_experts lets them (run by our forward then, parallelize_hf_experts)
    offer_experts_to_float8(model, options)
    convert_blocks_to_float8(repeated_blocks(model), dims, options)
    if dims.tp_enabled:
        plan = hf_tensor_plan(model, sequence_parallel=sequence_parallel)
        parallelize_tensor(model, dims.mesh_for("tp"), plan)
        localize_head_counts(model, split_modules(model), dims.tp)
    if dims.cp_enabled:
        parallelize_hf_context(model, dims.mesh_for("cp"), options.context_attention, tp=dims.tp)
    else:  # no host sync in the mask preparation of a plain causal forward
        causal_attention_without_mask_sync(model)
    parallelize_hf_experts(model, dims, options)
    # under tp the MoE blocks ran on this rank's sequence shard: their gradients sum over tp
    sum_gradients_over_tp(moe_blocks(model).values(), dims, options)
    train_without_cache(model)
    if options.compile:
        unwrap_hub_kernel_forwards(model)
    # Decoder layers may hold dropout (attention_dropout, hidden dropout): recompute keeps the RNG state.
    parallelize_blocks(model, repeated_blocks(model), dims, options, moe=bool(moe_blocks(model)))


def train_without_cache(model: nn.Module) -> None:
    """In training, call ``model`` with ``use_cache=False`` unless the caller says otherwise.

    The configs default to ``use_cache=True``, and a causal LM then builds a KV cache in every forward, training
    too: it keeps every layer's keys and values alive until the step ends, and each layer appends to it again when
    activation checkpointing recomputes the layer, so the recompute attends over twice the positions (selective
    recompute fails: "aten.slice.Tensor invocation index 4 encountered during backward but not found in
    storage"). ``transformers`` itself turns the cache off only under its own gradient checkpointing.

    Out of training too (validation) when ``position_ids`` come without a cache of the caller's: with a cache,
    ``transformers`` skips its packed-sequence check (``masking_utils``), so packed rows would attend across their
    documents. Generation hands its own cache (``past_key_values`` / ``cache``) and keeps it.
    """
    parameters = inspect.signature(model.forward).parameters
    if "use_cache" not in parameters:
        return

    def no_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        # "cache" is transformers' newer name for past_key_values (5.x)
        packed = kwargs.get("position_ids") is not None and all(
            kwargs.get(name) is None for name in ("past_key_values", "cache")
        )
        if (module.training or packed) and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    model.register_forward_pre_hook(no_cache, with_kwargs=True)
