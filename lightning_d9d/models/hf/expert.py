"""Expert parallelism for a ``transformers`` MoE model, read from its config's expert-parallel plan.

``transformers`` ships the plan in every MoE config: ``config.base_model_ep_plan`` maps module-name patterns of the
base model to style names; ``"grouped_gemm"`` marks the stacked expert weights (``layers.*.mlp.experts.gate_up_proj``,
``...down_proj``: the expert on dimension 0) and ``"ep_dispatch_experts"`` the experts module, the point where the
tokens go to their experts (older plans name it ``"moe_tp_experts"``). There, the model's MoE block calls
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` after its own router, so the router,
its top-k and its load-balancing loss stay exactly as the model computes them. :func:`parallelize_hf_experts` changes,
for each experts module:

- the stacked weights become ``DTensor``s sharded over ``ep`` on the expert dimension, and the module its own FSDP
  unit over the ranks that hold the same experts, gradients divided by the ranks whose loss is averaged
  (:func:`~lightning_d9d.plans.expert.split_expert_weights`, as for our own MoE blocks);
- its forward (:func:`expert_parallel_forward`): our dispatcher (all-to-all over ``ep``, DeepEP where installed
  and asked for: :func:`~lightning_d9d.modules.moe.expert_parallel_dispatcher`) brings each rank the rows of its
  local experts, grouped by expert; one grouped GEMM per projection runs them
  (:func:`~lightning_d9d.kernels.grouped_mm`) in ``transformers``' weight layout (``gate_up_proj [E, 2 * ffn,
  hidden]`` with the gate rows first, ``down_proj [E, hidden, ffn]``, the module's own ``act_fn``), each row's
  activation weighed by its router weight before the down projection; the rows come back and are summed per
  token.

Refused before any collective (:func:`check_hf_expert_model`): a config without ``base_model_ep_plan`` (a dense
model), a plan that names no experts module, an experts module that is not ``transformers``' stacked layout (other
parameters, biases, another forward signature), and an ``ep`` that does not divide the number of experts.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels import grouped_mm, weigh_rows
from lightning_d9d.kernels.grouped_gemm_fp8 import FLOAT8_BACKEND
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf.config_plans import expert_modules
from lightning_d9d.modules.moe import LocalDispatcher, Routing, TokenDispatcher, expert_parallel_dispatcher
from lightning_d9d.plans.expert import split_expert_weights
from lightning_d9d.plans.options import ParallelOptions

# The experts module's layout: its parameters and its forward's arguments.
WEIGHTS = ("gate_up_proj", "down_proj")
ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
# The instance attributes an expert-parallel experts module holds its dispatcher and its number of experts in.
_DISPATCHER, _NUM_EXPERTS = "_d9d_dispatcher", "_d9d_num_experts"
log = logging.getLogger("lightning_d9d.models.hf")


def check_hf_expert_model(model: nn.Module, ep: int) -> None:
    """Refuse, from the model alone (before any collective), what :func:`parallelize_hf_experts` cannot split."""
    name, config = type(model).__name__, getattr(model, "config")  # noqa: B009  (untyped here)
    if not getattr(config, "base_model_ep_plan", None):
        raise ValueError(
            f"{name}: ep={ep} needs an expert-parallel plan, but its config ({type(config).__name__}) has no "
            "base_model_ep_plan (a dense model has no experts to split); use ep=1"
        )
    found = expert_modules(model)
    if not found:
        raise ValueError(
            f"{name}: ep={ep}: its config's base_model_ep_plan names no experts module of the model "
            f"({sorted(config.base_model_ep_plan)}); use ep=1"
        )
    for module_name, experts in found.items():
        _check_layout(name, module_name, experts, ep)


def _layout_problem(experts: nn.Module) -> str | None:
    """Why the adapter's forward (:func:`expert_parallel_forward`) cannot run ``experts`` (``None``: it can):
    it takes ``transformers``' stacked layout only."""
    own = dict(experts.named_parameters(recurse=False))
    act_fn = getattr(experts, "act_fn", None)
    others = [child for child in experts.children() if child is not act_fn]
    if sorted(own) != sorted(WEIGHTS) or others:
        return (
            f"holds {sorted(own)}; the adapter takes only transformers' stacked experts "
            f"({' and '.join(WEIGHTS)}, no biases)"
        )
    arguments = [p for p in inspect.signature(type(experts).forward).parameters if p != "self"]
    if tuple(arguments[: len(ARGUMENTS)]) != ARGUMENTS or not callable(act_fn):
        return (
            f"has a forward taking {arguments} and act_fn={act_fn!r}; the adapter's forward replaces "
            f"forward({', '.join(ARGUMENTS)}) with an act_fn"
        )
    experts_count, double_ffn, hidden = own["gate_up_proj"].shape
    if own["down_proj"].shape != (experts_count, hidden, double_ffn // 2):
        return (
            f"has gate_up_proj {tuple(own['gate_up_proj'].shape)} and down_proj {tuple(own['down_proj'].shape)}, "
            "not transformers' [E, 2 * ffn, hidden] / [E, hidden, ffn]"
        )
    return None


def _check_layout(name: str, module_name: str, experts: nn.Module, ep: int) -> None:
    prefix = f"{name}: ep={ep}: {module_name} ({type(experts).__name__})"
    problem = _layout_problem(experts)
    if problem is not None:
        raise NotImplementedError(f"{prefix} {problem}; use ep=1")
    experts_count = experts.get_parameter("gate_up_proj").shape[0]
    if experts_count % ep:
        raise ValueError(
            f"{prefix}: ep ({ep}) must divide the number of experts ({experts_count}): each ep rank holds "
            f"experts / ep of them; choose an ep among the divisors of {experts_count}"
        )


def offer_experts_to_float8(model: nn.Module, options: ParallelOptions) -> list[nn.Module]:
    """Where the FP8 plan may train the experts in float8 (``options.fp8`` set, ``fp8_experts`` not ``False``):
    give every experts module of ``model`` in ``transformers``' stacked layout the
    :class:`~lightning_d9d.modules.moe.GroupedGemmExperts` trait (``gemm_backend=None``, its widths), so that
    :func:`~lightning_d9d.plans.fp8.convert_experts_to_float8` decides on it as on our experts; returns them.
    :func:`parallelize_hf_experts` then runs those it pointed at the float8 backend through our forward. A layout
    the adapter cannot run keeps ``transformers``' forward, in bf16: refused under ``fp8_experts=True``. Call it
    before the float8 conversion."""
    if options.fp8 is None or options.fp8_experts is False:
        return []
    offered = []
    for module_name, experts in expert_modules(model).items():
        problem = _layout_problem(experts)
        if problem is not None:
            if options.fp8_experts:
                raise ValueError(
                    f"fp8_experts=True: {type(model).__name__}'s {module_name} ({type(experts).__name__}) {problem}; "
                    "leave fp8_experts=None (its experts then keep transformers' forward, in bf16)"
                )
            log.info("fp8: %s keeps transformers' experts forward, in bf16: it %s", module_name, problem)
            continue
        _, double_ffn, hidden = experts.get_parameter("gate_up_proj").shape
        # plain attributes (the module is transformers'): read by the FP8 plan and by expert_parallel_forward
        setattr(experts, "gemm_backend", None)  # noqa: B010
        setattr(experts, "hidden_size", int(hidden))  # noqa: B010
        setattr(experts, "intermediate_size", int(double_ffn) // 2)  # noqa: B010
        offered.append(experts)
    return offered


def parallelize_hf_experts(
    model: nn.Module, dims: ParallelDims, options: ParallelOptions, *, dispatch_backend: str | None = None
) -> list[nn.Module]:
    """Split every experts module of ``model`` over ``ep`` (see the module docstring); returns them. Without ep
    only the experts the FP8 plan pointed at the float8 grouped GEMM (:func:`offer_experts_to_float8`) change:
    our forward with a local dispatcher, since ``transformers``' own never reaches our registry. Call it after
    tp / cp and before the block plan (recompute, compile, FSDP)."""
    if not dims.ep_enabled:
        changed = []
        for experts in expert_modules(model).values():
            if getattr(experts, "gemm_backend", None) == FLOAT8_BACKEND:
                _run_ours(experts, LocalDispatcher())
                changed.append(experts)
        return changed
    check_hf_expert_model(model, dims.ep)
    group = dims.mesh_for("ep").get_group()
    changed = []
    for experts in expert_modules(model).values():
        num_experts = int(experts.get_parameter("gate_up_proj").shape[0])
        split_expert_weights(experts, dims, options)
        _run_ours(experts, expert_parallel_dispatcher(group, num_experts, backend=dispatch_backend))
        changed.append(experts)
    return changed


def _run_ours(experts: nn.Module, dispatcher: TokenDispatcher) -> None:
    setattr(experts, _DISPATCHER, dispatcher)
    setattr(experts, _NUM_EXPERTS, int(experts.get_parameter("gate_up_proj").shape[0]))
    experts.forward = types.MethodType(expert_parallel_forward, experts)  # type: ignore[method-assign]


def expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``transformers``' experts forward with the experts split over ``ep``: ``[T, H]`` rows, each token's top-k
    experts and weights -> ``[T, H]``, the weighted sum of its experts' outputs."""
    dispatcher: TokenDispatcher = getattr(self, _DISPATCHER)
    gate_up_proj = _local(self.get_parameter("gate_up_proj"))
    down_proj = _local(self.get_parameter("down_proj"))
    counts = torch.bincount(top_k_index.reshape(-1), minlength=getattr(self, _NUM_EXPERTS))
    empty = top_k_weights.new_empty(0)  # the router's logits and probabilities: no dispatcher reads them
    routing = Routing(top_k_index, top_k_weights, counts, logits=empty, probs=empty)
    dispatched = dispatcher.dispatch(hidden_states, routing)
    # the FP8 plan's backend where it chose float8 (offer_experts_to_float8), else the registry's choice; the
    # transposed weights are column-major per expert, the float8 kernels' layout, so they are read without a copy
    backend = getattr(self, "gemm_backend", None)
    counts = dispatched.tokens_per_expert
    gate_up = grouped_mm(dispatched.tokens, gate_up_proj.transpose(1, 2), counts, backend=backend)
    gate, up = gate_up.chunk(2, dim=-1)
    act_fn: Any = self.act_fn
    # each row weighed by its routing weight before the down projection (combine only sums: see moe.dispatch)
    activation = weigh_rows(act_fn(gate) * up, dispatched.row_weights)
    output = grouped_mm(activation, down_proj.transpose(1, 2), counts, backend=backend)
    return dispatcher.combine(output, dispatched)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts (FSDP has gathered its own dimension by now); the gradient flows back into the DTensor."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
