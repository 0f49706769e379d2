"""The parallel plans a ``transformers`` model ships, read as module names of the model.

``config.base_model_tp_plan`` and ``config.base_model_ep_plan`` map module-name patterns of the base model
(``"layers.*.self_attn.q_proj"``, ``*`` for a layer number) to style names; the causal LM class's ``_tp_plan``
adds the head; ``config.base_model_pp_plan`` and the class's ``_pp_plan`` the pipeline cut. A family whose config
ships none gets the adapter's own (:mod:`.family_plans`). The tensor-parallel, expert-parallel and pipeline plans
(:mod:`.tensor`, :mod:`.expert`, :mod:`.pipeline`) all start here: which modules a plan names, and which modules
are the MoE blocks (the parents of the experts modules).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from lightning_d9d.models.hf.family_plans import PipelinePart, family_plans

# Expert-parallel plan style names (of the transformers versions we support).
GROUPED_WEIGHTS = ("grouped_gemm",)
DISPATCH_POINT = ("ep_dispatch_experts", "moe_tp_experts")


def _base_prefix(model: nn.Module) -> str:
    """``"model."`` when the plans' patterns are relative to a base model held under that prefix, else ``""``."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""


def config_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as ``transformers`` assembles it, keyed by patterns relative to
    ``model``: the config's ``base_model_tp_plan`` (or the adapter's for its family) under the base model's
    prefix, then the class's ``_tp_plan`` (the head). Empty when neither has one."""
    base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    ours = family_plans(model.config)
    if not base_plan and ours is not None:
        base_plan = dict(ours.tp)
    if not base_plan:
        return {}
    at = _base_prefix(model)
    plan = {f"{at}{pattern}": style for pattern, style in base_plan.items()}
    plan.update(head_tp_plan(model))
    return plan


def head_tp_plan(model: nn.Module) -> dict[str, str]:
    """The head's part of the plan: the causal LM class's ``_tp_plan`` (the instance attribute of that name holds
    the whole merged plan; the adapter's for its family where the class has none), or for a pipeline stage of one
    its ``head_tp_plan``."""
    carried = getattr(model, "head_tp_plan", None)
    if carried is not None:
        return dict(carried)
    own = dict(getattr(type(model), "_tp_plan", None) or {})
    ours = family_plans(model.config)
    return own if own or ours is None else dict(ours.head_tp)


def config_pp_plan(model: nn.Module) -> dict[str, PipelinePart]:
    """The config's ``base_model_pp_plan`` (part -> input names, output names), or the adapter's for its family;
    empty when neither has one."""
    plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
    ours = family_plans(model.config)
    return plan if plan or ours is None else dict(ours.pp)


def head_pp_plan(model: nn.Module) -> dict[str, PipelinePart]:
    """The causal LM class's ``_pp_plan`` (the head), or the adapter's for its family; empty when neither has
    one."""
    plan = dict(getattr(type(model), "_pp_plan", None) or {})
    ours = family_plans(model.config)
    return plan if plan or ours is None else dict(ours.head_pp)


def config_ep_plan(model: nn.Module) -> dict[str, str]:
    """The config's ``base_model_ep_plan`` keyed by patterns relative to ``model`` (empty when it has none)."""
    plan = dict(getattr(model.config, "base_model_ep_plan", None) or {})
    at = _base_prefix(model)
    return {f"{at}{pattern}": style for pattern, style in plan.items()}


def expand_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``plan``'s patterns (``*`` stands for a layer number, as in ``transformers``) matched against the
    module names of ``module``: module name -> style name. Patterns that match nothing are left out."""
    names = [name for name, _ in module.named_modules() if name]
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name in names:
            if regex.fullmatch(name):
                expanded[name] = style
    return expanded


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules the ep plan names (by module name): those styled as the dispatch point, else the
    parents of the grouped weights."""
    split = expand_plan(model, config_ep_plan(model))
    names = [name for name, style in split.items() if style in DISPATCH_POINT]
    if not names:
        names = sorted({name.rpartition(".")[0] for name, style in split.items() if style in GROUPED_WEIGHTS})
    modules = dict(model.named_modules())
    return {name: modules[name] for name in names if name in modules}


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE blocks (by module name): the parents of the experts modules, which hold the router too."""
    modules = dict(model.named_modules())
    parents = sorted({name.rpartition(".")[0] for name in expert_modules(model)})
    return {name: modules[name] for name in parents if name in modules}
