"""FP8 training of the repeated blocks' linear layers through torchao's float8 training (an optional extra).

Each selected ``nn.Linear`` becomes torchao's ``Float8Linear``: its forward and both backward matmuls run in
float8 with dynamic scales (the master weights, the optimizer and the rest of the model stay as they were).
Two recipes:

- ``"tensorwise"``: one scale per tensor; the fastest on Hopper. Under FSDP2 the weights are cast to float8
  *before* the all-gather (``enable_fsdp_float8_all_gather``), so the gather moves half the bytes of bf16.
- ``"rowwise"``: one scale per row (per token of the activations, per output channel of the weights), more
  robust to outliers; torchao's recommended recipe for accuracy, gathered in bf16 under FSDP2.

What is converted (:func:`fp8_linear_filter`, which a user may replace): the linear layers inside the repeated
blocks (attention projections, dense MLPs, a transformers MoE's per-expert linears) whose both dimensions divide
by 16, as float8 matmuls require. Not the embedding, the LM head (outside the blocks: its logits feed the loss,
where precision matters most), and not routers (a linear named ``gate`` or ``router``: their top-k choice is
discontinuous, and they are small). Our grouped experts are not ``nn.Linear``s and stay in bf16.

Applied before checkpointing, compile and FSDP (``parallelize_blocks``): the conversion swaps modules, and
compile must see the float8 casts to fuse them. Under tp the plan is refused for now (torchao's float8 needs its
own tensor-parallel styles, not composed yet).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lightning_d9d.mesh import ParallelDims

FP8_RECIPES = ("tensorwise", "rowwise")
Fp8Filter = Callable[[nn.Module, str], bool]
log = logging.getLogger("lightning_d9d.plans")
_UNDER_TP = (
    "fp8={recipe!r} with tp={tp}: float8 linears under tensor parallelism need torchao's own parallel styles, not "
    "composed yet; use tp=1 (FSDP, cp, ep and pp compose), or fp8=None"
)


def check_fp8(recipe: str | None, *, owner: str, tp: int = 1) -> str | None:
    """Refuse an unknown recipe, one without torchao installed, or one under tp, before any process group."""
    if recipe is None:
        return None
    if recipe not in FP8_RECIPES:
        raise ValueError(
            f"{owner}: fp8={recipe!r}; choose one of {', '.join(map(repr, FP8_RECIPES))}, or None"
        )
    if tp > 1:
        raise NotImplementedError(_UNDER_TP.format(recipe=recipe, tp=tp))
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            f"{owner}: fp8={recipe!r} needs torchao's float8 training: pip install 'lightning-d9d[fp8]' (or "
            "torchao), or leave fp8=None"
        )
    return recipe


def fp8_linear_filter(module: nn.Module, name: str) -> bool:
    """The default choice of linear layers to train in float8 (module docstring): dims divisible by 16, not a
    router. ``name`` is the module's name inside its block."""
    if not isinstance(module, nn.Linear):
        return False
    if name.rsplit(".", 1)[-1] in ("gate", "router"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(
    blocks: Sequence[nn.Module],
    recipe: str,
    dims: ParallelDims,
    *,
    module_filter: Fp8Filter | None = None,
    fsdp: bool,
) -> int:
    """Convert the chosen linear layers of every block in ``blocks`` to float8 training in place; returns how many.

    ``fsdp``: whether FSDP2 will shard these blocks (then tensorwise casts before the all-gather)."""
    if dims.tp_enabled:
        raise NotImplementedError(_UNDER_TP.format(recipe=recipe, tp=dims.tp))
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config: Any = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp:  # the recipe's casts, the weights all-gathered in float8
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = module_filter or fp8_linear_filter
    converted = 0

    def counted(module: nn.Module, name: str) -> bool:
        nonlocal converted
        take = chosen(module, name)
        converted += int(take and isinstance(module, nn.Linear))
        return take

    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=counted, config=config)
    if converted == 0:
        raise ValueError(
            f"fp8={recipe!r}: no linear layer of the model's blocks was chosen (both dims must divide by 16, "
            "and the filter must accept it); leave fp8=None, or pass a module filter that selects some"
        )
    log.info("fp8 (%s): %d linear layers train in float8", recipe, converted)
    return converted
