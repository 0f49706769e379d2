"""The tp plan styles with which ``transformers`` gathers what a head-parallel split keeps on its rank.

``transformers`` runs some attentions and MLPs whole on every tp rank: ``"colwise_gather_output"`` all-gathers a
column-parallel projection's output, ``"rowwise_split_input"`` takes a whole input and uses this rank's slice.
Its plans say so where the forward needs every feature between the two: a fused projection that the forward
slices by the config's sizes (Phi-3's ``qkv_proj``, Phi-3's and GLM-4's ``gate_up_proj``, ``chunk(2)``), or norms
over all heads' features together (OLMo 2's ``q_norm`` / ``k_norm``). Run so, every rank computes every head.
We split the work by heads instead, each rank holding whole heads and matching gate/up halves:

- a fused projection (:func:`fused_sections`): its weight stays ``Shard(0)`` over tp, as ``transformers``'
  own style places it, its output is all-gathered, and each rank keeps this rank's part of every section (its
  q, k and v heads; its gate and up columns: :class:`FusedColumns`). A permuted shard (each rank's weight rows
  its own heads' q, k and v) would need no gather, but no placement describes it: ``_StridedShard`` describes
  equal sections only (not grouped-query q/k/v), and FSDP's 2-D layout on top of it labels the shards wrongly
  (``full_tensor()`` of a ``_StridedShard`` tp weight under ``fully_shard`` at dp=2 x tp=2 is not the weight, on
  torch 2.13), so checkpoints would store permuted rows. The gather costs one all-gather of the projection's
  output forward and a reduce-scatter backward;
- an unfused ``q_proj`` / ``k_proj`` / ``v_proj`` is split by heads as ``"colwise"`` is; a norm in the same
  attention whose features are such a projection's whole output (OLMo 2) normalises this rank's heads with the
  statistic over every rank's (:class:`FeatureShardedNorm`: its weight ``Shard(0)``, the input read as
  ``Shard(-1)``, so that the mean of squares reduces over tp);
- ``"rowwise_split_input"`` then takes this rank's part as it is (``"rowwise"``).

DeepSeek-V3's multi-head latent attention (``"mla_kv_a_proj"`` on ``kv_a_proj_with_mqa``): the low-rank projections
stay whole on every rank (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``: their
outputs feed column-parallel projections, whose input gradient tp sums, so their gradients are whole), ``q_proj`` /
``q_b_proj`` and ``kv_b_proj`` are split by heads, ``o_proj`` by rows. The latent's rotary part (the last
``qk_rope_head_dim`` features) goes to every head as the shared key rotation, bypassing ``kv_b_proj``: each rank's
heads give it a partial gradient, which :class:`MlaLatentProjection` sums over tp.

An attention whose forward reads its head counts from the config (Phi-3: ``self.config.num_attention_heads *
self.head_dim`` where q ends in the fused output) gets a copy of the config with this rank's counts
(:func:`localize_config`).

Anything else these styles name is refused by :func:`check_head_split`, naming the module. Nothing here imports
``transformers``.
"""

from __future__ import annotations

import ast
import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_d9d.models.hf.loss import forward_tree

GATHERED_COLUMN = "colwise_gather_output"
MLA_LATENT = "mla_kv_a_proj"
HEAD_SPLIT_STYLES = (GATHERED_COLUMN, MLA_LATENT)
# Fused projections by name, as transformers' families lay them out: q | k | v by the attention's head counts,
# gate | up in halves (the forward's chunk(2, dim=-1)).
FUSED_QKV, FUSED_GATE_UP = "qkv_proj", "gate_up_proj"
# Unfused projections a gathered style may split by heads.
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# MLA's low-rank path before its column-parallel projections, whole on every rank.
MLA_LOW_RANK = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")
# The config's head counts an attention may read in its forward.
CONFIG_COUNTS = ("num_attention_heads", "num_key_value_heads")


# ------------------------------------------------------------------------------------------------ the layouts
def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _parent(modules: Mapping[str, nn.Module], name: str) -> nn.Module:
    return modules[name.rpartition(".")[0]]


def fused_sections(
    attention: nn.Module, name: str, projection: nn.Module, config: Any
) -> tuple[int, ...] | None:
    """How the forward splits the fused projection ``name``'s output, in order (``None`` where the sizes do not
    add up to its width): ``qkv_proj`` -> the q, k and v widths (the config's head counts, or the module's own
    ``num_key_value_heads``, times its ``head_dim``), ``gate_up_proj`` -> two halves."""
    width = getattr(projection, "out_features", None)
    if not isinstance(width, int):
        return None
    if _leaf(name) == FUSED_GATE_UP:
        return (width // 2, width // 2) if width % 2 == 0 else None
    head_dim = getattr(attention, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(attention, "num_key_value_heads", getattr(config, "num_key_value_heads", None))
    if not (isinstance(head_dim, int) and isinstance(heads, int) and isinstance(kv_heads, int)):
        return None
    sections = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return sections if sum(sections) == width else None


def _rope_dim(config: Any, projection: nn.Module) -> int | None:
    """MLA's rotary width (``qk_rope_head_dim``) where the latent projection's output ends in it."""
    rope = getattr(config, "qk_rope_head_dim", None)
    width = getattr(projection, "out_features", None)
    if isinstance(rope, int) and isinstance(width, int) and 0 < rope < width:
        return rope
    return None


def full_width_norms(model: nn.Module, split: Mapping[str, str]) -> list[str]:
    """Norms over a gathered q/k/v projection's whole output (OLMo 2's ``q_norm`` / ``k_norm``), by module name:
    in the projection's attention, not in the plan, their parameters ``[width]`` vectors of such a projection's
    width."""
    modules = dict(model.named_modules())
    found: list[str] = []
    for name, style in split.items():
        if style != GATHERED_COLUMN or _leaf(name) not in HEAD_PROJECTIONS:
            continue
        attention_name = name.rpartition(".")[0]
        width = getattr(modules[name], "out_features", None)
        for child_name, child in modules[attention_name].named_children():
            full = f"{attention_name}.{child_name}"
            params = list(child.parameters())
            if (
                full not in split
                and full not in found
                and params
                and all(p.ndim == 1 and p.shape[0] == width for p in params)
            ):
                found.append(full)
    return found


def mla_low_rank(model: nn.Module, split: Mapping[str, str]) -> list[str]:
    """MLA's low-rank modules (whole on every rank) of each attention whose latent projection the plan names."""
    modules = dict(model.named_modules())
    attentions = {name.rpartition(".")[0] for name, style in split.items() if style == MLA_LATENT}
    return [
        f"{attention}.{child}"
        for attention in sorted(attentions)
        for child in MLA_LOW_RANK
        if isinstance(getattr(modules[attention], child, None), nn.Module)
    ]


def covered(model: nn.Module, split: Mapping[str, str]) -> set[str]:
    """Modules the plan does not name that these translations account for (the full-width norms, split with the
    heads; MLA's low-rank path, whole)."""
    return {*full_width_norms(model, split), *mla_low_rank(model, split)}


# ------------------------------------------------------------------------------------------------- checks
def check_head_split(model: nn.Module, split: Mapping[str, str], tp: int) -> None:
    """Refuse, naming the module, a gathered column or an MLA latent projection this module cannot split by
    heads (see the module docstring for those it can)."""
    owner = f"{type(model).__name__}: tp={tp}"
    modules = dict(model.named_modules())
    config = model.config
    for name, style in split.items():
        module = modules[name]
        if style == GATHERED_COLUMN:
            if not isinstance(module, nn.Linear):
                raise NotImplementedError(
                    f"{owner}: {name} ({type(module).__name__}) has the style {style!r}, which the adapter "
                    "splits on an nn.Linear only; use tp=1"
                )
            leaf = _leaf(name)
            if leaf in (FUSED_QKV, FUSED_GATE_UP):
                _refuse_adapted(module, name, owner)
                sections = fused_sections(_parent(modules, name), name, module, config)
                if sections is None or any(size % tp for size in sections):
                    raise NotImplementedError(
                        f"{owner}: the fused projection {name} ({module.out_features} features) does not split "
                        f"into sections tp divides ({sections}); use tp=1"
                    )
            elif leaf not in HEAD_PROJECTIONS:
                raise NotImplementedError(
                    f"{owner}: the tp plan's style {style!r} (for {name}) is not translated yet; the adapter "
                    f"splits it by heads on {', '.join((*HEAD_PROJECTIONS, FUSED_QKV, FUSED_GATE_UP))} only. "
                    "Use tp=1"
                )
        elif style == MLA_LATENT and (not isinstance(module, nn.Linear) or _rope_dim(config, module) is None):
            raise NotImplementedError(
                f"{owner}: the tp plan's style {style!r} (for {name}) is not translated yet; the adapter splits "
                "MLA's latent projection only: an nn.Linear whose output ends in the config's qk_rope_head_dim "
                f"({getattr(config, 'qk_rope_head_dim', None)}). Use tp=1"
            )
    for name in full_width_norms(model, split):
        width = next(modules[name].parameters()).shape[0]
        if width % tp:
            raise ValueError(f"{owner}: tp ({tp}) must divide {name}'s width ({width})")


def _refuse_adapted(module: nn.Module, name: str, owner: str) -> None:
    """:class:`FusedColumns` cuts a plain linear's output; LoRA's and float8's styles shard column-parallel
    layers of their own, which would not cut it."""
    if type(module) is not nn.Linear:
        raise NotImplementedError(
            f"{owner}: the fused projection {name} is a {type(module).__name__}, and the adapter splits fused "
            "projections by heads on a plain nn.Linear only (not LoRA-adapted or float8 yet); leave it out of "
            "LoRA's targets and fp8, or use tp=1"
        )


# ------------------------------------------------------------------------------------------------- styles
class FusedColumns(ParallelStyle):
    """A fused projection (``sections``: its output's parts in order, each split over tp) whose forward hands on
    this rank's part of every section: the weight ``Shard(0)`` (``transformers``' own layout for it), the output
    all-gathered and cut (see the module docstring for why not a permuted shard)."""

    def __init__(self, sections: tuple[int, ...]) -> None:
        super().__init__()
        self.sections = sections

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # converted to float8 after the checks (parallelize_hf's order): refused here, on every rank alike
        _refuse_adapted(module, type(module).__name__, "FusedColumns")
        ColwiseParallel(output_layouts=Replicate(), use_local_output=False)._apply(module, device_mesh)
        module.register_forward_hook(functools.partial(self._take_own, mesh=device_mesh))
        return module

    def _take_own(self, module: nn.Module, args: Any, output: DTensor, *, mesh: DeviceMesh) -> torch.Tensor:
        # Each rank's gradient of the whole output is nonzero on its own parts only: a partial sum over tp,
        # which the all-gather's backward then reduce-scatters.
        whole = output.to_local(grad_placements=[Partial()])
        rank, size = mesh.get_local_rank(), mesh.size()
        parts = torch.split(whole, list(self.sections), dim=-1)
        return torch.cat([part.chunk(size, dim=-1)[rank] for part in parts], dim=-1)


class FeatureShardedNorm(ParallelStyle):
    """A norm over all heads' features (OLMo 2's q / k norms) run on this rank's heads: its parameters
    ``Shard(0)`` over tp, its input read as ``Shard(-1)`` so that its own forward's statistic (a mean over the
    features) reduces over every rank, its output handed on as this rank's part."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_: str, owner: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(owner.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
                owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

        def as_sharded(_: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            features = DTensor.from_local(args[0], mesh, [Shard(-1)], run_check=False)
            return (features, *args[1:])

        def as_local(_: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local()

        return distribute_module(module, device_mesh, shard, as_sharded, as_local)  # type: ignore[arg-type]


class MlaLatentProjection(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa``, whole on every rank: the gradient of its output's last ``rope_dim``
    features (the shared key rotation, read by this rank's heads only) summed over tp."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(functools.partial(self._sum_rope_gradient, mesh=device_mesh))
        return module

    def _sum_rope_gradient(
        self, _: nn.Module, args: Any, output: torch.Tensor, *, mesh: DeviceMesh
    ) -> torch.Tensor:
        latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        # the identity forward; backward: the Partial gradient all-reduced to the Replicate input
        rope = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()]
        )
        return torch.cat([latent, rope], dim=-1)


def head_split_plan(model: nn.Module, split: Mapping[str, str]) -> dict[str, ParallelStyle]:
    """The styles of the modules these translations split (module name -> style): gathered columns, MLA's latent
    projections, the full-width norms; each hands on a plain local tensor, with or without sequence parallelism.
    ``split``: the plan's modules but the head and the embedding. Call :func:`check_head_split` first."""
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = {}
    for name, style in split.items():
        module = modules[name]
        if style == GATHERED_COLUMN and _leaf(name) in (FUSED_QKV, FUSED_GATE_UP):
            sections = fused_sections(_parent(modules, name), name, module, model.config)
            assert sections is not None  # check_head_split
            plan[name] = FusedColumns(sections)
        elif style == GATHERED_COLUMN:
            plan[name] = ColwiseParallel()
        elif style == MLA_LATENT:
            rope = _rope_dim(model.config, module)
            assert rope is not None  # check_head_split
            plan[name] = MlaLatentProjection(rope)
    for name in full_width_norms(model, split):
        plan[name] = FeatureShardedNorm()
    return plan


# -------------------------------------------------------------------------------------------- head counts
@functools.cache
def _config_counts_read(module_class: Any) -> frozenset[str]:
    """The config head counts ``module_class.forward`` reads as ``self.config.<count>``."""
    function = forward_tree(module_class)
    if function is None:
        return frozenset()
    return frozenset(
        node.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and node.attr in CONFIG_COUNTS
        and ast.unparse(node.value) == "self.config"
    )


def localize_config(module: nn.Module, tp: int) -> None:
    """Where ``module``'s forward reads head counts from its config: a copy of the config with this rank's
    counts for ``module`` alone (the model's config and every other module keep the whole counts)."""
    config = getattr(module, "config", None)
    module_class: Any = type(module)  # cached per class
    read = _config_counts_read(module_class)
    if config is None or not read:
        return
    local = copy.copy(config)
    for count in read:
        value = getattr(config, count, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(local, count, value // tp)
    module.config = local
