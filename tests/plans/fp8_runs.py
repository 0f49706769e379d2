"""What the FP8 tests of our Qwen3 share (``test_fp8.py``, ``test_fp8_compositions.py``): the tiny Qwen3 with
torchao's conversion applied by hand, its one-process references, the emulations under which one process takes the
float8 scales a parallel run takes (per tp shard, per cp rank), what its first block's attention receives, and how
two runs' gradients are compared. The training loop and the rest that ``transformers`` models share are in
``tests/float8_training.py``."""

from __future__ import annotations

from typing import Any

import torch
from float8_training import SEQUENCE, STEPS, convert_by_hand, record_attention_input, split_forward, trained
from torch import nn

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.context_attention import LoadBalancedSplit

# AdamW moves an element by about lr per step whatever its gradient's size (step 1: lr * sign(g)); in float8 a
# last-bit difference of the fp32 sums (the row-parallel matmuls add two halves) can flip one float8 rounding, and
# at lr=1e-2 such flips compound within 5 steps (0.02 in the loss by step 3, measured). At lr=1e-3 the model still
# learns (5.56 -> 5.14) and the comparison stays tight.
TP_LR = 1e-3


def tiny_model(*, moe: bool = False) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    """The seeded tiny Qwen3, or with ``moe`` the tiny Qwen3-MoE (layers 0 and 2 sparse, 1 dense)."""
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny()) if moe else Qwen3ForCausalLM(Qwen3Config.tiny())


def converted_by_hand(recipe: str | None, *, moe: bool = False) -> Any:
    """The seeded tiny model (:func:`tiny_model`), one process, no DTensor: torchao's conversion applied to the
    blocks by hand (an MoE block's router and grouped experts are no ``nn.Linear``: they stay as they are)."""
    model = tiny_model(moe=moe)
    convert_by_hand(model.model.layers.values(), recipe)
    return model


def split_like_tp(model: Any) -> Any:
    """Every float8 linear of the one-process ``model`` (a Qwen3 or a Qwen3-MoE) multiplies per shard of tp=2
    (:func:`split_forward`), as Qwen3's tensor plan splits it (column- or row-parallel; an MoE block is no part of
    the split: it routes whole weights on each rank's positions)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear

    from lightning_d9d.models.qwen3 import tensor_plan

    plan = tensor_plan(model.model, model.lm_head, prefix="model.")
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            assert isinstance(plan[name], (ColwiseParallel, RowwiseParallel)), name
            split_forward(module, column=isinstance(plan[name], ColwiseParallel))
    return model


def split_like_cp(model: Any, cp: int) -> Any:
    """Every float8 linear of the one-process ``model`` multiplies the positions each of ``cp`` ranks holds
    (:class:`LoadBalancedSplit`) on their own, as the cp ranks do: a linear sees its rank's tokens only, so its
    dynamic scales of the activations (and, in backward, of grad_output) are taken over them, and its weight's
    gradient is the sum of the ranks' products. Attention still sees the whole sequence, as cp's does."""
    from torchao.float8.float8_linear import Float8Linear

    held = [LoadBalancedSplit(cp, rank).positions(SEQUENCE) for rank in range(cp)]
    order = torch.argsort(torch.cat(held))

    def per_rank(module: nn.Module) -> None:
        whole = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            parts = [whole(x.index_select(1, positions)) for positions in held]
            return torch.cat(parts, dim=1).index_select(1, order)

        module.forward = forward  # type: ignore[method-assign]

    for module in model.modules():
        if isinstance(module, Float8Linear):
            per_rank(module)
    return model


def reference_run(
    recipe: str | None,
    *,
    parts: int = 1,
    lr: float = TP_LR,
    tp: bool = False,
    cp: int = 1,
    moe: bool = False,
    steps: int = STEPS,
) -> dict[str, Any]:
    """One process, no DTensor, torchao's conversion by hand: the batch in ``parts`` parts one after the other (as
    ``parts`` data-parallel ranks or pipeline microbatches see it); with ``tp``, every float8 linear multiplies per
    tp shard (:func:`split_like_tp`: rowwise under tp scales per shard); with ``cp``, per cp rank's positions
    (:func:`split_like_cp`). ``moe``: the tiny Qwen3-MoE, whose router losses (attached to each part's backward)
    count ``1 / parts`` as each part's loss does: the data ranks' gradients are averaged."""
    model = converted_by_hand(recipe, moe=moe)
    if moe:
        model.set_router_loss_scale(1 / parts)
    if tp:
        split_like_tp(model)
    if cp > 1:
        split_like_cp(model, cp)
    return trained(model, range(parts), parts, lr=lr, steps=steps)


def first_attention_input(model: nn.Module) -> dict[str, Any]:
    """Filled by every forward: what layer 0's attention receives (:func:`record_attention_input` on its input
    norm and its attention)."""
    layer = model.model.layers["0"]  # type: ignore[index]
    return record_attention_input(layer.input_layernorm, layer.self_attn)
