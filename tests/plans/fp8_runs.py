"""What the FP8 tests share (``test_fp8.py``, ``test_fp8_compositions.py``): the tiny Qwen3's training loop, its
one-process references with torchao's conversion applied by hand, and the emulations under which one process
takes the float8 scales a parallel run takes (per tp shard, per cp rank)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import local_loss, maybe_loss_parallel, split_batch
from lightning_d9d.plans.fp8 import fp8_linear_filter

STEPS = 5
ROWS, SEQUENCE = 4, 32  # each batch: 4 rows of 32 tokens

# AdamW moves an element by about lr per step whatever its gradient's size (step 1: lr * sign(g)); in float8 a
# last-bit difference of the fp32 sums (the row-parallel matmuls add two halves) can flip one float8 rounding, and
# at lr=1e-2 such flips compound within 5 steps (0.02 in the loss by step 3, measured). At lr=1e-3 the model still
# learns (5.56 -> 5.14) and the comparison stays tight.
TP_LR = 1e-3

# Under activation checkpointing a block's parameters are named inside its wrapper: compared by the plain name
_WRAPPED = "._checkpoint_wrapped_module"


def float8_names(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    # a pattern a model can learn within a few steps: each row counts up from a random start
    starts = torch.randint(0, 200, (STEPS, ROWS, 1), generator=generator)
    tokens = (starts + torch.arange(SEQUENCE + 1)) % 256
    return [(row[:, :-1], row[:, 1:]) for row in tokens]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name.replace(_WRAPPED, ""): _whole(p) for name, p in model.named_parameters()}


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name.replace(_WRAPPED, "")] = _whole(p.grad)
    return grads


def train(
    model: nn.Module,
    ranks: range,
    world: int,
    *,
    vocab_parallel: bool = False,
    lr: float = 1e-2,
    context: LoadBalancedSplit | None = None,
    first_grads: dict[str, torch.Tensor] | None = None,
) -> list[float]:
    """5 AdamW steps; each step's batch cut into ``world`` equal parts of which this process runs ``ranks``.

    One process runs several parts one after the other (their gradients summed, each loss divided by their
    number): float8's dynamic scales of the activations are taken over the tensor a matmul sees, so the reference
    must see each rank's part on its own, as the ranks do. ``vocab_parallel``: the logits come vocabulary-sharded
    (tp), the loss runs under ``loss_parallel``. ``context``: this cp rank's split of every sequence. The loss
    reported is the mean over the processes (data-parallel ranks hold different parts, cp ranks different
    tokens). ``first_grads``: filled with the whole gradients of the first step, before the optimizer's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, (inputs, labels) in enumerate(batches()):
        step_loss = torch.zeros(())
        for rank in ranks:
            part = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
            ids, target = inputs[part], labels[part]
            if context is not None:
                (ids,), target = split_batch(context, (ids,), target)
            with maybe_loss_parallel(vocab_parallel):
                loss = local_loss(causal_lm_loss(model(ids), target)) / len(ranks)
                loss.backward()
            step_loss += loss.detach()
        if step == 0 and first_grads is not None:
            first_grads.update(full_gradients(model))
        optimizer.step()
        optimizer.zero_grad()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(step_loss)
            step_loss /= dist.get_world_size()
        losses.append(float(step_loss))
    return losses


def trained(model: nn.Module, ranks: range = range(1), world: int = 1, **options: Any) -> dict[str, Any]:
    """:func:`train`'s losses, its first gradients and the parameters it ends with."""
    grads: dict[str, torch.Tensor] = {}
    losses = train(model, ranks, world, first_grads=grads, **options)
    return {"losses": losses, "grads": grads, "params": full_parameters(model)}


def converted_by_hand(recipe: str | None) -> Qwen3ForCausalLM:
    """The seeded tiny model, one process, no DTensor: torchao's conversion applied to the blocks by hand."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    if recipe is not None:
        for block in model.model.layers.values():
            convert_to_float8_training(
                block, module_filter_fn=fp8_linear_filter, config=Float8LinearConfig.from_recipe_name(recipe)
            )
    return model


def split_forward(module: nn.Module, *, column: bool, parts: int = 2) -> None:
    """``module`` (a one-process ``Float8Linear``) multiplies per tp shard, as ``parts`` tp ranks do under torch's
    plain styles: column-parallel, per block of output features (its outputs concatenated; in backward its
    grad_input is the sum of the blocks' products, each operand scaled over its own block of the contraction);
    row-parallel, per block of input features (the blocks' outputs summed, each scaled over its own block)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def product(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul_with_hp_or_float8_args.apply(a, weight.t(), module.linear_mm_config, module.config)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if column:
            return torch.cat([product(x, w) for w in module.weight.chunk(parts, 0)], dim=-1)
        outputs = [
            product(a, w) for a, w in zip(x.chunk(parts, -1), module.weight.chunk(parts, 1), strict=True)
        ]
        total = outputs[0]
        for output in outputs[1:]:
            total = total + output
        return total

    module.forward = forward  # type: ignore[method-assign]


def split_like_tp(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Every float8 linear of the one-process ``model`` multiplies per shard of tp=2 (:func:`split_forward`), as
    Qwen3's tensor plan splits it (column- or row-parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear

    from lightning_d9d.models.qwen3 import tensor_plan

    plan = tensor_plan(model.model, model.lm_head, prefix="model.")
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            assert isinstance(plan[name], (ColwiseParallel, RowwiseParallel)), name
            split_forward(module, column=isinstance(plan[name], ColwiseParallel))
    return model


def split_like_cp(model: Qwen3ForCausalLM, cp: int) -> Qwen3ForCausalLM:
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
    recipe: str | None, *, parts: int = 1, lr: float = TP_LR, tp: bool = False, cp: int = 1
) -> dict[str, Any]:
    """One process, no DTensor, torchao's conversion by hand: the batch in ``parts`` parts one after the other (as
    ``parts`` data-parallel ranks or pipeline microbatches see it); with ``tp``, every float8 linear multiplies per
    tp shard (:func:`split_like_tp`: rowwise under tp scales per shard); with ``cp``, per cp rank's positions
    (:func:`split_like_cp`)."""
    model = converted_by_hand(recipe)
    if tp:
        split_like_tp(model)
    if cp > 1:
        split_like_cp(model, cp)
    return trained(model, range(parts), parts, lr=lr)


def first_attention_input(model: nn.Module) -> dict[str, Any]:
    """Filled by the first forward: what layer 0's attention receives (hook on its input norm's output and on
    the attention's own input)."""
    seen: dict[str, Any] = {"float8 inputs": 0}
    layer = model.model.layers["0"]  # type: ignore[index]

    def norm_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.setdefault("amax", float(output.detach().abs().max()))

    def attention_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        local = args[0].to_local() if hasattr(args[0], "to_local") else args[0]
        if type(local).__name__ == "Float8TrainingTensor":  # torchao's float8 gather: scale and all
            seen["float8 inputs"] += 1
            seen.setdefault("scale", float(local._scale))

    if hasattr(layer.input_layernorm, "register_forward_hook"):
        layer.input_layernorm.register_forward_hook(norm_output)
    layer.self_attn.register_forward_pre_hook(attention_input)
    return seen


def gloo_gathers_float8_as_bytes() -> None:
    """gloo has no float8 type ("Invalid scalar type"); NCCL gathers float8 as bytes. torchao's float8 all-gather
    (the activations before tp's sequence gather, the gradients in backward) then moves the same bytes as uint8
    here: this rank's process only (the ranks are forked)."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    funcol = torch.ops._c10d_functional
    gather = FLOAT8_OPS_TABLE[funcol.all_gather_into_tensor.default]

    def as_bytes(aten_op: Any, args: Any, kwargs: Any = None) -> Any:
        def through_bytes(data: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
            out = funcol.wait_tensor(aten_op(data.view(torch.uint8), *rest, **kw))
            return out.view(data.dtype)

        return gather(through_bytes, args, kwargs or {})

    for op in (
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        funcol.all_gather_into_tensor.default,
    ):
        FLOAT8_OPS_TABLE[op] = as_bytes


def gradient_differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the norm of two runs' gradient difference as a fraction of the expected gradient's norm.

    A norm, not the largest entry: a last-bit difference of fp32 sums can flip one float8 rounding (an element
    moves by a float8 step, 1/8 of it in e4m3), which moves a few gradient entries by up to 1e-4 of the largest
    (measured) but hardly the norm (1e-5 measured), where a wrong scale moves every entry (a gradient scaled by
    1.01: 1e-2)."""
    assert got.keys() == expected.keys()
    return {name: float((got[name] - g).norm() / g.norm()) for name, g in expected.items()}
