"""LoRA as a plan: the layers a :class:`LoRA` config names get low-rank adapters, everything else is frozen.

It runs first, before every other plan (``strategies/prepare.adapt``), so tensor, context, expert and pipeline
parallelism, recompute, compile and FSDP all see the adapted module: an adapted layer is still an ``nn.Linear``
(:class:`~lightning_d9d.modules.lora.LoRALinear`) under its old name, with ``lora_A`` / ``lora_B`` beside its
weight. Under tensor parallelism :func:`lora_tensor_plan` shards each adapter with its base layer: a
column-parallel base (output features split) keeps ``A`` whole and splits ``B``'s rows as its own; a row-parallel
base (input features split) splits ``A``'s columns as its own and keeps ``B`` whole. No rank then gathers
anything the base layer's own split does not.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_d9d.modules.lora import LoRALinear, init_adapter_

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
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: Sequence[str] = field(default=BLOCK_LINEARS)
    base_dtype: torch.dtype | None = None

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
    pattern or layer and the fix."""
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
                raise ValueError(
                    f"LoRA: target {pattern!r} matches {name} ({kind}), which LoRA cannot adapt: only plain "
                    "nn.Linear layers take adapters; narrow the pattern to the linear layers inside it"
                )
            smallest = min(child.in_features, child.out_features)
            if config.rank > smallest:
                raise ValueError(
                    f"LoRA: rank ({config.rank}) exceeds {name}'s smaller side ({child.in_features} in, "
                    f"{child.out_features} out); choose rank <= {smallest} or leave {name} out of targets"
                )
            found[name] = child
    return found


def apply_lora(module: nn.Module, config: LoRA, seed: int) -> dict[str, LoRALinear]:
    """Adapt ``module`` in place: each target layer replaced by a :class:`LoRALinear` around its own weight,
    every other parameter frozen (and cast to ``config.base_dtype``). Adapters of layers that hold memory are
    initialised from ``seed`` (``A`` seeded by its name, ``B`` zero); on ``meta`` they wait for
    :func:`init_adapters_` after the model's own initialisation. Returns the adapted layers by name."""
    targets = lora_targets(module, config)
    adapted: dict[str, LoRALinear] = {}
    for name, base in targets.items():
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        layer = LoRALinear.from_linear(
            base, config.rank, config.alpha, dropout=config.dropout, dtype=base.weight.dtype
        )
        setattr(parent, child_name, layer)
        adapted[name] = layer
    adapter_params = {id(p) for layer in adapted.values() for p in _adapter_params(layer)}
    for param in module.parameters():
        if id(param) in adapter_params:
            continue
        param.requires_grad_(False)
        if config.base_dtype is not None and param.is_floating_point():
            param.data = param.data.to(config.base_dtype)
    init_adapters_(adapted, seed, skip_meta=True)
    return adapted


def _adapter_params(layer: LoRALinear) -> list[torch.Tensor]:
    return [layer.lora_A.weight, layer.lora_B.weight]


def init_adapters_(adapted: Mapping[str, LoRALinear], seed: int, *, skip_meta: bool = False) -> None:
    """Initialise each adapter from ``seed`` and its name, alike on every layout; ``skip_meta``: leave those
    still on ``meta`` (they have no memory yet)."""
    for name, layer in adapted.items():
        if skip_meta and layer.lora_A.weight.is_meta:
            continue
        init_adapter_(layer, name, seed)


def adapted_layers(module: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` in ``module``, by name."""
    return {name: child for name, child in module.named_modules() if isinstance(child, LoRALinear)}


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
