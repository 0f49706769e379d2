"""LoRA as a plan: the layers a :class:`LoRA` config names get low-rank adapters, everything else is frozen.

It runs first, before every other plan (``strategies/prepare.adapt``), so tensor, context, expert and pipeline
parallelism, recompute, compile and FSDP all see the adapted module: an adapted layer is still an ``nn.Linear``
(:class:`~lightning_d9d.modules.lora.LoRALinear`) under its old name, with ``lora_A`` / ``lora_B`` beside its
weight. Under tensor parallelism :func:`lora_tensor_plan` shards each adapter with its base layer: a
column-parallel base (output features split) keeps ``A`` whole and splits ``B``'s rows as its own; a row-parallel
base (input features split) splits ``A``'s columns as its own and keeps ``B`` whole. No rank then gathers
anything the base layer's own split does not.

``LoRA(experts=True)`` also adapts every stacked-experts module (:func:`stacked_experts`: our
:class:`~lightning_d9d.modules.moe.GroupedExperts`, and what a model family registers with
:func:`register_experts_finder`, as the ``transformers`` adapter does for a MoE's experts module): per-expert
adapters (:class:`~lightning_d9d.modules.lora.ExpertsLoRA`) beside each stacked weight, the expert on dimension 0
as in the weights. Expert parallelism then splits them with their experts and FSDP over ``efsdp`` shards them with
the experts (:func:`~lightning_d9d.plans.expert.split_expert_weights`); under tensor parallelism the MoE blocks run
token-local with whole weights, so the adapters stay whole too and their gradients are summed over tp with the
experts' (:mod:`lightning_d9d.plans.routing`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_d9d.modules.lora import (
    EXPERTS_ADAPTER,
    ExpertsLoRA,
    LoRALinear,
    StackedWeight,
    experts_adapter,
    init_adapter_,
)
from lightning_d9d.modules.moe import GroupedExperts

# The projections of a decoder block in Llama-style models (ours, and transformers' dense families).
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRA:
    """Low-rank adaptation of a model's linear layers (``D9DStrategy(lora=LoRA(...))``).

    Args:
        rank: the adapters' inner size ``r``; at most the smaller side of every adapted layer.
        alpha: the update is scaled by ``alpha / rank``.
        dropout: dropout on the adapters' input (the base layer sees the input untouched).
        targets: which layers to adapt, as patterns over module names: a bare name (``"q_proj"``) matches that
            last part of any name (``model.layers.3.self_attn.q_proj``); a pattern with dots or wildcards
            (``"model.layers.*.mlp.*_proj"``) is matched against the whole name (``fnmatch``). Each pattern must
            match at least one ``nn.Linear``, and nothing else. Default: every projection of the decoder blocks.
        base_dtype: the dtype the frozen weights are kept in (``torch.bfloat16`` halves their memory); ``None``
            keeps the model's. The adapters stay in the model's dtype.
        experts: also give every stacked-experts module per-expert adapters on each of its stacked weights (our
            ``GroupedExperts``, a ``transformers`` MoE's experts module in its stacked layout); a model without
            any is refused. Experts held as ``nn.Linear`` layers are plain linears: name them in ``targets``.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: Sequence[str] = field(default=BLOCK_LINEARS)
    base_dtype: torch.dtype | None = None
    experts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):  # a single pattern given as a string: one target, not its letters
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"LoRA: rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA: dropout must lie in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError(
                "LoRA: targets is empty; name the layers to adapt, e.g. targets=('q_proj', 'v_proj')"
            )
        if self.base_dtype is not None and not self.base_dtype.is_floating_point:
            raise ValueError(f"LoRA: base_dtype must be a floating-point dtype, got {self.base_dtype}")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def lora_targets(module: nn.Module, config: LoRA) -> dict[str, nn.Linear]:
    """The layers ``config`` adapts in ``module`` (name -> layer), each checked: every pattern matches something,
    everything matched is an ``nn.Linear`` whose sides both hold the rank. Raises ``ValueError`` naming the
    pattern or layer and the fix. The stacked experts ``config.experts`` adapts: :func:`lora_expert_targets`."""
    named = [(name, child) for name, child in module.named_modules() if name]
    found: dict[str, nn.Linear] = {}
    for pattern in config.targets:
        hits = [(name, child) for name, child in named if _matches(name, pattern)]
        if not hits:
            linears = [name for name, child in named if type(child) is nn.Linear]
            example = ", ".join(linears[:4]) or "none"
            raise ValueError(
                f"LoRA: target {pattern!r} matches no module of {type(module).__name__}; its linear layers are "
                f"named like {example}: give a last name part ('q_proj') or a whole-name pattern "
                "('model.layers.*.self_attn.q_proj')"
            )
        for name, child in hits:
            if isinstance(child, LoRALinear) or type(child) is not nn.Linear:
                kind = "already adapted" if isinstance(child, LoRALinear) else type(child).__name__
                stacked = any(p.dim() == 3 for p in child.parameters(recurse=False))
                raise ValueError(
                    f"LoRA: target {pattern!r} matches {name} ({kind}), which LoRA cannot adapt: only plain "
                    "nn.Linear layers take adapters; narrow the pattern to the linear layers inside it"
                    + ("; stacked experts take theirs with LoRA(experts=True)" if stacked else "")
                )
            _check_rank(config, name, child.in_features, child.out_features, f"leave {name} out of targets")
            found[name] = child
    return found


def _check_rank(config: LoRA, name: str, in_features: int, out_features: int, alternative: str) -> None:
    """``config.rank`` fits the layer (for stacked experts: each expert's matrix)."""
    smallest = min(in_features, out_features)
    if config.rank > smallest:
        raise ValueError(
            f"LoRA: rank ({config.rank}) exceeds {name}'s smaller side ({in_features} in, {out_features} out); "
            f"choose rank <= {smallest} or {alternative}"
        )


# ------------------------------------------------------------------------------------------ stacked experts
@dataclass(frozen=True)
class StackedExperts:
    """A stacked-experts module LoRA can adapt: its ``weights`` as LoRA sees them, and ``run_adapters``, what makes
    its forward add its adapters' updates once they are attached (``None``: its forward does already)."""

    module: nn.Module
    weights: Mapping[str, StackedWeight]
    run_adapters: Callable[[], None] | None = None


# model -> its stacked experts by module name; raises ValueError naming an experts module it cannot adapt
ExpertsFinder = Callable[[nn.Module], dict[str, StackedExperts]]
_FINDERS: list[ExpertsFinder] = []


def register_experts_finder(finder: ExpertsFinder) -> None:
    """Teach :func:`stacked_experts` a model family's stacked experts beyond ``GroupedExperts`` (the models layer
    registers its own: this layer imports none of it)."""
    if finder not in _FINDERS:
        _FINDERS.append(finder)


def stacked_experts(module: nn.Module) -> dict[str, StackedExperts]:
    """Every stacked-experts module of ``module`` LoRA can adapt, by name: each ``GroupedExperts``, and what the
    registered finders find."""
    found = {
        name: StackedExperts(child, child.stacked_weights())
        for name, child in module.named_modules()
        if isinstance(child, GroupedExperts)
    }
    for finder in _FINDERS:
        found.update(finder(module))
    return found


def lora_expert_targets(module: nn.Module, config: LoRA) -> dict[str, StackedExperts]:
    """The stacked experts ``config`` adapts in ``module`` (none unless ``config.experts``), each checked: not
    adapted yet, every stacked weight holding the rank per expert. Raises ``ValueError`` naming the module and
    the fix; a model without stacked experts is refused."""
    if not config.experts:
        return {}
    found = stacked_experts(module)
    if not found:
        expert_linears = [
            name
            for name, child in module.named_modules()
            if type(child) is nn.Linear and "experts" in name.split(".")[:-1]
        ]
        held = (
            f"; its experts are nn.Linear layers ({', '.join(expert_linears[:3])}, ...), which targets adapts by "
            "name (e.g. 'experts.*.down_proj')"
            if expert_linears
            else ""
        )
        raise ValueError(
            f"LoRA(experts=True): {type(module).__name__} has no stacked experts (GroupedExperts, or a "
            f"transformers MoE's experts module in its stacked layout){held}; use experts=False"
        )
    for name, experts in found.items():
        if experts_adapter(experts.module) is not None:
            raise ValueError(f"LoRA(experts=True): {name} is already adapted; adapt a model once")
        for weight, stacked in experts.weights.items():
            _check_rank(
                config, f"{name}.{weight}", stacked.in_features, stacked.out_features, "use experts=False"
            )
    return found


def apply_lora(module: nn.Module, config: LoRA, seed: int) -> dict[str, LoRALinear | ExpertsLoRA]:
    """Adapt ``module`` in place: each target layer replaced by a :class:`LoRALinear` around its own weight, each
    stacked-experts module (``config.experts``) given an :class:`ExpertsLoRA`, every other parameter frozen (and
    cast to ``config.base_dtype``). Everything is checked before anything changes. Adapters of layers that hold
    memory are initialised from ``seed`` (``A`` seeded by its name, ``B`` zero); on ``meta`` they wait for
    :func:`init_adapters_` after the model's own initialisation. Returns the adapters by name (a
    ``LoRALinear`` under its layer's name, an ``ExpertsLoRA`` under its own, ``<experts>.lora``)."""
    targets = lora_targets(module, config)
    expert_targets = lora_expert_targets(module, config)
    adapted: dict[str, LoRALinear | ExpertsLoRA] = {}
    for name, base in targets.items():
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        layer = LoRALinear.from_linear(
            base, config.rank, config.alpha, dropout=config.dropout, dtype=base.weight.dtype
        )
        setattr(parent, child_name, layer)
        adapted[name] = layer
    for name, experts in expert_targets.items():
        adapted[f"{name}.{EXPERTS_ADAPTER}"] = _adapt_experts(experts, config)
    adapter_params = {id(p) for layer in adapted.values() for p in _adapter_params(layer)}
    for param in module.parameters():
        if id(param) in adapter_params:
            continue
        param.requires_grad_(False)
        if config.base_dtype is not None and param.is_floating_point():
            param.data = param.data.to(config.base_dtype)
    init_adapters_(adapted, seed, skip_meta=True)
    return adapted


def _adapt_experts(experts: StackedExperts, config: LoRA) -> ExpertsLoRA:
    base = experts.module.get_parameter(next(iter(experts.weights)))
    adapter = ExpertsLoRA(
        experts.weights,
        config.rank,
        config.alpha,
        dropout=config.dropout,
        device=base.device,
        dtype=base.dtype,
    )
    setattr(experts.module, EXPERTS_ADAPTER, adapter)
    adapter.train(experts.module.training)
    if experts.run_adapters is not None:
        experts.run_adapters()
    return adapter


def _adapter_params(layer: LoRALinear | ExpertsLoRA) -> list[torch.Tensor]:
    if isinstance(layer, ExpertsLoRA):
        return list(layer.parameters())
    return [layer.lora_A.weight, layer.lora_B.weight]


def adapter_on_meta(layer: LoRALinear | ExpertsLoRA) -> bool:
    """Whether ``layer``'s adapter has no memory yet (built on ``meta``)."""
    return any(p.is_meta for p in _adapter_params(layer))


def init_adapters_(
    adapted: Mapping[str, LoRALinear | ExpertsLoRA], seed: int, *, skip_meta: bool = False
) -> None:
    """Initialise each adapter from ``seed`` and its name, alike on every layout; ``skip_meta``: leave those
    still on ``meta`` (they have no memory yet)."""
    for name, layer in adapted.items():
        if skip_meta and adapter_on_meta(layer):
            continue
        init_adapter_(layer, name, seed)


def adapted_layers(module: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` in ``module``, by name."""
    return {name: child for name, child in module.named_modules() if isinstance(child, LoRALinear)}


def adapters(module: nn.Module) -> dict[str, LoRALinear | ExpertsLoRA]:
    """Every adapter in ``module``, by name: each :class:`LoRALinear` and each :class:`ExpertsLoRA`."""
    return {
        name: child for name, child in module.named_modules() if isinstance(child, (LoRALinear, ExpertsLoRA))
    }


# ---------------------------------------------------------------------------------------- tensor parallel
class LoRAParallel(ParallelStyle):
    """A column- or row-parallel ``style`` for an adapted layer: the base weight and bias as ``style`` shards
    them, the adapter beside them so that the update has the base output's layout (see the module docstring)."""

    def __init__(self, style: ColwiseParallel | RowwiseParallel) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            raise TypeError(f"LoRAParallel applies to LoRALinear, not {type(module).__name__}")
        # the base style partitions every submodule and Parameter it finds: hide the adapter from it
        children, module._modules = module._modules, {}
        try:
            self.style._apply(module, device_mesh)
        finally:
            module._modules = children
        column = isinstance(self.style, ColwiseParallel)
        _distribute_weight(module.lora_A, device_mesh, Replicate() if column else Shard(1))
        _distribute_weight(module.lora_B, device_mesh, Shard(0) if column else Replicate())
        return module


def _distribute_weight(linear: nn.Linear, mesh: DeviceMesh, placement: Placement) -> None:
    weight = linear.weight
    linear.weight = nn.Parameter(
        distribute_tensor(weight.detach(), mesh, [placement]), requires_grad=weight.requires_grad
    )


def lora_tensor_plan(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with each column- or row-parallel style of an adapted layer wrapped in :class:`LoRAParallel`."""
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        adapted = isinstance(module.get_submodule(name), LoRALinear)
        out[name] = (
            LoRAParallel(style)
            if adapted and isinstance(style, (ColwiseParallel, RowwiseParallel))
            else style
        )
    return out
