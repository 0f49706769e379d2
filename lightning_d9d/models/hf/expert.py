"""Expert parallelism for a ``transformers`` MoE model, read from its config's expert-parallel plan.

``transformers`` ships the plan in every MoE config: ``config.base_model_ep_plan`` maps module-name patterns of the
base model to style names; ``"grouped_gemm"`` marks the stacked expert weights (``layers.*.mlp.experts.gate_up_proj``,
``...down_proj``: the expert on dimension 0) and ``"ep_dispatch_experts"`` the experts module, the point where the
tokens go to their experts (older plans name it ``"moe_tp_experts"``). There, the model's MoE block calls
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` after its own router, so the router,
its top-k and its load-balancing loss stay exactly as the model computes them. :func:`parallelize_hf_experts` changes,
for each experts module:

- the stacked weights (and GPT-OSS's per-expert biases) become ``DTensor``s sharded over ``ep`` on the expert
  dimension, and the module its own FSDP unit over the ranks that hold the same experts, gradients divided by the
  ranks whose loss is averaged (:func:`~lightning_d9d.plans.expert.split_expert_weights`, as for our own MoE
  blocks);
- its forward (:func:`expert_parallel_forward`): our dispatcher (all-to-all over ``ep``, DeepEP where installed
  and asked for: :func:`~lightning_d9d.modules.moe.expert_parallel_dispatcher`) brings each rank the rows of its
  local experts, grouped by expert; one grouped GEMM per projection runs them
  (:func:`~lightning_d9d.kernels.grouped_mm`) in the module's layout (:mod:`.expert_layouts`: ``transformers``'
  usual ``gate_up_proj [E, 2 * ffn, hidden]`` with the gate rows first, ``down_proj [E, hidden, ffn]`` and the
  module's own ``act_fn``, each row's activation weighed by its router weight before the down projection; or
  GPT-OSS's transposed weights with their biases, gate and up interleaved, its clamped SwiGLU, the router weight
  on the output); the rows come back and are summed per token.

Refused before any collective (:func:`check_hf_expert_model`): a config without ``base_model_ep_plan`` (a dense
model), a plan that names no experts module, an experts module in neither layout (other parameters, another forward
signature, or a forward that computes otherwise on a small CPU probe: gate and up read otherwise, another gate),
and an ``ep`` that does not divide the number of experts.

Without ``ep`` the same forward runs with a local dispatcher (a permutation by expert; no exchange) wherever the
probe finds it exact, unless ``$LIGHTNING_D9D_HF_KERNELS=0``: ``transformers``' own grouped forward, compiled
over fp32 weights (one GPU with ``fsdp_on_one_rank=False``, the CUDA-graph setting), falls back to a host loop
over the experts in fp32 (``transformers::grouped_mm_fallback``, reading the offsets on the host), where ours runs
the grouped GEMM in autocast's dtype, every step on the device.

LoRA (``LoRA(experts=True)``): :func:`lora_hf_experts`, registered with the LoRA plan, offers it every experts
module the ep plan names; one in the usual stacked layout takes per-expert adapters
(:class:`~lightning_d9d.modules.lora.ExpertsLoRA`, as ``lora``) and runs our forward from then on, on any degree
(with the local dispatcher until a plan changes it), which adds each projection's adapter update to its grouped
GEMM's output; another layout is refused naming the module. The adapters are split over ``ep`` with their experts.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from lightning_d9d.kernels import count_tokens_per_expert, grouped_mm, loop_grouped_mm
from lightning_d9d.kernels.grouped_gemm_fp8 import FLOAT8_BACKEND
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf.config_plans import expert_modules
from lightning_d9d.models.hf.expert_layouts import (
    STACKED,
    ExpertsLayout,
    describe_layouts,
    layout_named,
    probe_parameters,
)
from lightning_d9d.models.hf.kernels import ENV_VAR as HF_KERNELS_ENV_VAR
from lightning_d9d.models.hf.kernels import hf_kernels_enabled
from lightning_d9d.modules.hf_init import is_transformers_model
from lightning_d9d.modules.lora import ExpertsLoRA, StackedWeight, experts_adapter
from lightning_d9d.modules.moe import (
    ExpertTensorParallelDispatcher,
    LocalDispatcher,
    Routing,
    TokenDispatcher,
    expert_parallel_dispatcher,
)
from lightning_d9d.plans.expert import split_expert_weights
from lightning_d9d.plans.expert_tensor import check_expert_width, fused_columns, shard_experts_over_tp
from lightning_d9d.plans.lora import StackedExperts, register_experts_finder
from lightning_d9d.plans.options import ParallelOptions

# The instance attributes an expert-parallel experts module holds its dispatcher, its number of experts and its
# layout in.
_DISPATCHER, _NUM_EXPERTS, _LAYOUT = "_d9d_dispatcher", "_d9d_num_experts", "_d9d_layout"
# _forward_problem's findings, by class and settings
_PROBED: dict[tuple[Any, ...], str | None] = {}
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
    it takes the stacked layouts of :mod:`.expert_layouts` only (``transformers``' usual one and GPT-OSS's), and
    only where the class's own forward computes what ours does (:func:`_forward_problem`)."""
    layout = layout_named(experts)
    if layout is None:
        own = sorted(name for name, _ in experts.named_parameters(recurse=False))
        return f"holds {own}; the adapter takes only {describe_layouts()}"
    arguments = [p for p in inspect.signature(type(experts).forward).parameters if p != "self"]
    if tuple(arguments[: len(layout.arguments)]) != layout.arguments:
        return (
            f"has a forward taking {arguments}; the adapter's forward replaces "
            f"forward({', '.join(layout.arguments)})"
        )
    problem = layout.problem(experts)
    return problem if problem is not None else _forward_problem(experts, layout)


def _forward_problem(experts: nn.Module, layout: ExpertsLayout) -> str | None:
    """Whether the class's own forward computes what :func:`expert_parallel_forward` does (``None``: it does),
    read off a probe: a shallow copy of ``experts`` with small random fp32 weights on the CPU, its experts chosen
    at random for a few tokens, both forwards compared. Stacked experts may gate otherwise (gate and up
    interleaved, a clamped or shifted activation, a post-expert norm) under the same parameter names; the
    probe tells. Once per class and settings (the instance's plain attributes, the config's experts
    implementation)."""
    instance_forward = vars(experts).get("forward")
    if (
        instance_forward is not None
        and getattr(instance_forward, "__func__", None) is not expert_parallel_forward
    ):
        return "has a forward of its own on the instance, which the adapter would replace"
    config = getattr(experts, "config", None)
    settings = tuple(
        sorted((k, v) for k, v in vars(experts).items() if isinstance(v, (bool, int, float, str)))
    )
    implementation = getattr(config, "_experts_implementation", None)
    key: tuple[Any, ...] = (type(experts), type(getattr(experts, "act_fn", None)), settings, implementation)
    if key not in _PROBED:
        _PROBED[key] = _probe_forward(experts, layout)
    return _PROBED[key]


def _probe_forward(experts: nn.Module, layout: ExpertsLayout) -> str | None:
    num_experts = int(experts.get_parameter("gate_up_proj").shape[0])
    hidden, ffn, tokens, top_k = 16, 8, 12, min(2, num_experts)
    # the probe's own numbers, drawn without advancing the caller's RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parameters = probe_parameters(layout, experts, num_experts, hidden, ffn)
        hidden_states = torch.randn(tokens, hidden)
        top_k_index = torch.rand(tokens, num_experts).topk(top_k, dim=1).indices
        top_k_weights = torch.rand(tokens, top_k)
    probe = copy.copy(experts)  # shares act_fn and config; its own parameters and attributes below
    probe.__dict__["_parameters"] = dict(parameters)
    # the class's forward knows no adapters: both forwards compute the base
    probe.__dict__["_modules"] = {
        name: child for name, child in experts._modules.items() if not isinstance(child, ExpertsLoRA)
    }
    probe.__dict__.update({_DISPATCHER: LocalDispatcher(), _NUM_EXPERTS: num_experts, _LAYOUT: layout})
    try:
        with torch.no_grad():
            theirs = type(experts).forward(probe, hidden_states, top_k_index, top_k_weights)
            # the reference grouped GEMM: the registry's choice (a CUDA-only backend named in the environment,
            # say) must not decide whether the forward computes the class's numbers, nor be announced from here
            ours = _experts_forward(probe, hidden_states, top_k_index, top_k_weights, loop_grouped_mm)
    except Exception as error:  # a forward that needs more than the probe holds: not ours to replace
        return f"has a forward that failed on the adapter's probe ({type(error).__name__}: {error})"
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        return "has a forward whose output is not [tokens, hidden]; the adapter's forward returns that"
    if not torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6):
        return (
            f"has a forward that computes otherwise than {layout.math} (largest difference on a probe "
            f"{(theirs - ours).abs().max():.3g})"
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
    :func:`parallelize_hf_experts` then runs those it pointed at the float8 backend through our forward. Another
    layout (GPT-OSS's, or one the adapter cannot run) stays in bf16: refused under ``fp8_experts=True``. Call it
    before the float8 conversion."""
    if options.fp8 is None or options.fp8_experts is False:
        return []
    offered = []
    for module_name, experts in expert_modules(model).items():
        problem = _layout_problem(experts) or _stacked_only(experts, "the float8 grouped GEMM")
        if problem is not None:
            if options.fp8_experts:
                raise ValueError(
                    f"fp8_experts=True: {type(model).__name__}'s {module_name} ({type(experts).__name__}) {problem}; "
                    "leave fp8_experts=None (its experts then run in bf16)"
                )
            log.info("fp8: %s keeps its experts in bf16: it %s", module_name, problem)
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
    the experts keep their weights and run our forward with a local dispatcher where it computes what theirs
    does (:func:`_run_ours_locally`). Call it after tp / cp and before the block plan (recompute, compile,
    FSDP). With ``options.expert_tensor_parallel`` under tp each expert is split over tp instead
    (:func:`split_hf_experts_over_tp`)."""
    if options.expert_tensor_parallel and dims.tp_enabled:
        return split_hf_experts_over_tp(model, dims, options)
    if not dims.ep_enabled:
        return _run_ours_locally(model)
    check_hf_expert_model(model, dims.ep)
    group = dims.mesh_for("ep").get_group()
    changed = []
    for experts in expert_modules(model).values():
        num_experts = int(experts.get_parameter("gate_up_proj").shape[0])
        split_expert_weights(experts, dims, options)
        _run_ours(experts, expert_parallel_dispatcher(group, num_experts, backend=dispatch_backend))
        changed.append(experts)
    return changed


def check_hf_expert_tensor_model(model: nn.Module, tp: int) -> None:
    """Refuse, from the model alone (before any collective), what :func:`split_hf_experts_over_tp` cannot split:
    no experts module in the ep plan, one the adapter's forward cannot run or not in ``transformers``' usual
    stacked layout (GPT-OSS's biases come after the down projection, whose output is a partial sum over tp), or
    an expert width tp does not divide."""
    name = type(model).__name__
    found = expert_modules(model)
    if not found:
        raise ValueError(
            f"{name}: expert_tensor_parallel=True splits MoE experts, but its config's base_model_ep_plan names no "
            "experts module; set expert_tensor_parallel=False"
        )
    for module_name, experts in found.items():
        prefix = f"{name}: expert_tensor_parallel=True, tp={tp}: {module_name} ({type(experts).__name__})"
        problem = _layout_problem(experts) or _stacked_only(experts, "expert-tensor parallelism")
        if problem is not None:
            raise NotImplementedError(f"{prefix} {problem}; use expert_tensor_parallel=False")
        check_expert_width(int(experts.get_parameter("down_proj").shape[-1]), tp, prefix)


def split_hf_experts_over_tp(
    model: nn.Module, dims: ParallelDims, options: ParallelOptions
) -> list[nn.Module]:
    """Expert-tensor parallelism (:mod:`lightning_d9d.plans.expert_tensor`) for every experts module of
    ``model`` in ``transformers``' stacked layout: ``gate_up_proj [E, 2 * ffn, hidden]`` split on its gate/up rows
    (each tp rank its ``1/tp`` of the gate rows, then of the up rows), ``down_proj [E, hidden, ffn]`` on its ffn
    columns, the module its own FSDP unit over the data ranks; its forward ours, with the local dispatcher wrapped
    in the tp gather and reduce-scatter (:class:`~lightning_d9d.modules.moe.ExpertTensorParallelDispatcher`).
    Returns the modules changed."""
    check_hf_expert_tensor_model(model, dims.tp)
    tp = dims.mesh_for("tp")
    changed = []
    for experts in expert_modules(model).values():
        placements = {"gate_up_proj": fused_columns(1), "down_proj": Shard(2)}
        shard_experts_over_tp(experts, placements, dims, options)
        _run_ours(experts, ExpertTensorParallelDispatcher(LocalDispatcher(), tp))
        changed.append(experts)
    return changed


def _run_ours_locally(model: nn.Module) -> list[nn.Module]:
    """Without ep: every experts module the adapter's forward computes exactly (:func:`_layout_problem`) runs it
    with a local dispatcher, unless ``$LIGHTNING_D9D_HF_KERNELS=0``; the float8 experts always (only ours reaches
    the float8 grouped GEMM). Why: ``transformers``' own grouped forward, compiled over fp32 weights (autocast
    without FSDP's bf16 copies: ``fsdp_on_one_rank=False``), leaves ``torch.nn.functional.grouped_mm`` for a loop
    over the experts in fp32 that reads the group offsets on the host (``transformers::grouped_mm_fallback``),
    which a CUDA graph cannot capture; ours casts to autocast's dtype and takes the grouped GEMM registry's choice,
    with routing and permutation on the device."""
    changed, kept = [], {}
    for module_name, experts in expert_modules(model).items():
        # only ours reaches the float8 grouped GEMM, and only ours adds LoRA's per-expert adapters
        ours_only = (
            getattr(experts, "gemm_backend", None) == FLOAT8_BACKEND or experts_adapter(experts) is not None
        )
        if not ours_only and not hf_kernels_enabled():
            continue
        problem = None if ours_only else _layout_problem(experts)
        if problem is None:
            _run_ours(experts, LocalDispatcher())
            changed.append(experts)
        else:
            kept[module_name] = problem
    if changed:
        log.info(
            "%s: %d experts modules run lightning_d9d's grouped GEMM forward (set $%s=0 to keep transformers')",
            type(model).__name__,
            len(changed),
            HF_KERNELS_ENV_VAR,
        )
    for module_name, problem in kept.items():
        log.info("%s keeps transformers' experts forward: it %s", module_name, problem)
    return changed


def _stacked_only(experts: nn.Module, what: str) -> str | None:
    """Why ``what`` (LoRA's adapters, the float8 grouped GEMM) cannot run ``experts``, in a layout the adapter
    runs otherwise: they take the usual stacked layout only (``None``: ``experts`` is in it)."""
    if layout_named(experts) is STACKED:
        return None
    own = sorted(name for name, _ in experts.named_parameters(recurse=False))
    return f"holds {own}; only transformers' stacked experts ({' and '.join(STACKED.weights)}) take {what}"


def _run_ours(experts: nn.Module, dispatcher: TokenDispatcher) -> None:
    setattr(experts, _DISPATCHER, dispatcher)
    setattr(experts, _NUM_EXPERTS, int(experts.get_parameter("gate_up_proj").shape[0]))
    setattr(experts, _LAYOUT, layout_named(experts))
    experts.forward = types.MethodType(expert_parallel_forward, experts)  # type: ignore[method-assign]


def expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``transformers``' experts forward with the experts split over ``ep``: ``[T, H]`` rows, each token's top-k
    experts and weights -> ``[T, H]``, the weighted sum of its experts' outputs."""
    # the FP8 plan's backend where it chose float8 (offer_experts_to_float8), else the registry's choice; the
    # transposed weights are column-major per expert, the float8 kernels' layout, so they are read without a copy
    backend = getattr(self, "gemm_backend", None)
    return _experts_forward(
        self, hidden_states, top_k_index, top_k_weights, functools.partial(grouped_mm, backend=backend)
    )


def _experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`expert_parallel_forward` with the grouped GEMM given (the probe runs the reference loop, whatever
    the registry would choose on this machine)."""
    dispatcher: TokenDispatcher = getattr(self, _DISPATCHER)
    layout: ExpertsLayout = getattr(self, _LAYOUT)
    # not bincount: on CUDA it reads the largest index on the host first, which a CUDA graph cannot capture
    counts = count_tokens_per_expert(top_k_index, getattr(self, _NUM_EXPERTS))
    empty = top_k_weights.new_empty(0)  # the router's logits and probabilities: no dispatcher reads them
    routing = Routing(top_k_index, top_k_weights, counts, logits=empty, probs=empty)
    dispatched = dispatcher.dispatch(hidden_states, routing)
    output = layout.run(self, dispatched.tokens, dispatched.tokens_per_expert, dispatched.row_weights, matmul)
    return dispatcher.combine(output, dispatched)


# ------------------------------------------------------------------------------------------------------ LoRA
def lora_hf_experts(module: nn.Module) -> dict[str, StackedExperts]:
    """The experts modules of every ``transformers`` MoE in ``module`` (the model itself or a module holding
    one), by name in ``module``, for ``LoRA(experts=True)``: each in the stacked layout the adapter's forward
    runs (its weights ``[E, out, in]``), switched to that forward once its adapters are attached. Raises
    ``ValueError`` naming an experts module in another layout."""
    found: dict[str, StackedExperts] = {}
    for prefix, model in _transformers_models(module).items():
        for name, experts in expert_modules(model).items():
            full_name = f"{prefix}.{name}" if prefix else name
            problem = _layout_problem(experts) or _stacked_only(experts, "LoRA's per-expert adapters")
            if problem is not None:
                raise ValueError(
                    f"LoRA(experts=True): {type(model).__name__}'s {full_name} ({type(experts).__name__}) "
                    f"{problem}; its experts take no adapters: use experts=False"
                )
            # in the module's own order: peft nests its wrappers in that order (state/hf/peft.py)
            weights = {
                weight: StackedWeight.of(param, out_first=True)
                for weight, param in experts.named_parameters(recurse=False)
            }
            found[full_name] = StackedExperts(experts, weights, functools.partial(_run_adapters, experts))
    return found


def _transformers_models(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost ``transformers`` models in ``module`` with an expert-parallel plan, by name."""
    found: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        inside = any(name.startswith(f"{outer}.") or not outer for outer in found)
        if inside or not is_transformers_model(child):
            continue
        if getattr(getattr(child, "config", None), "base_model_ep_plan", None):
            found[name] = child
    return found


def _run_adapters(experts: nn.Module) -> None:
    """Adapted experts run our forward (the class's knows nothing of the adapters): with the local dispatcher
    unless a plan gave them another already."""
    instance_forward = vars(experts).get("forward")
    if getattr(instance_forward, "__func__", None) is not expert_parallel_forward:
        _run_ours(experts, LocalDispatcher())


register_experts_finder(lora_hf_experts)
