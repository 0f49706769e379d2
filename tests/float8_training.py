"""What the FP8 tests share (``tests/plans/test_fp8.py`` and ``test_fp8_compositions.py`` for our models, through
``tests/plans/fp8_runs.py``; ``tests/models/hf/test_hf_fp8.py`` for ``transformers`` models; the Fabric loop's
reference, ``tests/fabric/fabric_loop.py``): a batch stream a model learns within a few steps, the training loop that
splits each step's batch as data-parallel ranks do (and, under cp, each sequence as the cp ranks do), the whole
parameters and gradients it ends with, torchao's conversion applied by hand for the one-process references, the
float8 linears' names, gloo moving float8 as bytes, what an attention receives, and one process multiplying per tp
shard. ``tests/`` is on ``sys.path`` (``tests/conftest.py``): ``from float8_training import ...`` from any test
folder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import local_loss, maybe_loss_parallel, split_batch
from lightning_d9d.plans.fp8 import fp8_linear_filter

STEPS = 5
ROWS, SEQUENCE = 4, 32  # each batch: 4 rows of 32 tokens
Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, input ids) -> logits

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


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Our models return the logits; a ``transformers`` model returns an output holding them."""
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


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
    eps: float = 1e-8,
    forward: Forward = logits_of,
    context: LoadBalancedSplit | None = None,
    first_grads: dict[str, torch.Tensor] | None = None,
    after_step: Callable[[int], None] | None = None,
    steps: int = STEPS,
) -> list[float]:
    """5 AdamW steps; each step's batch cut into ``world`` equal parts of which this process runs ``ranks``.

    One process runs several parts one after the other (their gradients summed, each loss divided by their
    number): float8's dynamic scales of the activations are taken over the tensor a matmul sees, so the reference
    must see each rank's part on its own, as the ranks do. ``vocab_parallel``: the logits come vocabulary-sharded
    (tp), the loss runs under ``loss_parallel``. ``eps``: AdamW's (the transformers tests say why they take 1e-4).
    ``forward``: the logits of a batch (:func:`logits_of` by default; a ``transformers`` model's packed rows pass
    their positions). ``context``: this cp rank's split of every sequence.

    The loss reported is the mean over the process group's processes (each process's own being the mean over the
    parts it ran): data-parallel ranks hold different parts, cp ranks different tokens, and tp ranks the same loss
    (whose mean is that loss, bitwise). ``first_grads``: filled with the whole gradients of the first step, before
    the optimizer's. ``after_step(i)``: called after the ``i``-th optimizer step. ``steps``: fewer than
    :data:`STEPS` for a reference compared on its first step only."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses = []
    for step, (inputs, labels) in enumerate(batches()[:steps]):
        step_loss = torch.zeros(())
        for rank in ranks:
            part = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
            ids, target = inputs[part], labels[part]
            if context is not None:
                (ids,), target = split_batch(context, (ids,), target)
            with maybe_loss_parallel(vocab_parallel):
                loss = local_loss(causal_lm_loss(forward(model, ids), target)) / len(ranks)
                loss.backward()
            step_loss += loss.detach()
        if step == 0 and first_grads is not None:
            first_grads.update(full_gradients(model))
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(step_loss)
            step_loss /= dist.get_world_size()
        losses.append(float(step_loss))
    return losses


def gradient_differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the norm of two runs' gradient difference as a fraction of the expected gradient's norm.

    A norm, not the largest entry: a last-bit difference of fp32 sums can flip one float8 rounding (an element
    moves by a float8 step, 1/8 of it in e4m3), which moves a few gradient entries by up to 1e-4 of the largest
    (measured) but hardly the norm (1e-5 measured), where a wrong scale moves every entry (a gradient scaled by
    1.01: 1e-2)."""
    assert got.keys() == expected.keys()
    return {name: float((got[name] - g).norm() / g.norm()) for name, g in expected.items()}


# The first step of two float8 runs that sum in different orders (a parallel layout against one process): the
# first loss within fp32's last bits at ~5.6 (4.8e-7 measured on x86 CPUs with and without AMX), the first
# gradients within GRADIENTS of each other by norm (gradient_differences: flipped float8 roundings move them by
# ~1e-5, a wrong scale by ~1e-2).
FIRST_LOSS = 2e-6
GRADIENTS = 1e-4
# Under torchao's float8 tp styles (tensorwise) the first gradients part further (most in layer 0's attention,
# which the most flipped roundings reach). Where the CPU's matmul kernels (AVX-512 / AMX) block their fp32 sums
# differently per shard, measured: 1.8e-3 (our Qwen3), 5.6e-3 (transformers' Qwen3), 9.5e-3 (our Qwen3-MoE).
# Scales taken per tp shard instead of over the whole tensor move them by 0.2 to 0.4 (these tests' per-shard references), a gradient 5 % off by 5e-2 (injected into
# the tp loss's backward: all four tensorwise tp tests failed).
TENSORWISE_TP_GRADIENTS = 2e-2


def assert_first_step_agrees(
    run: dict[str, Any],
    reference: dict[str, Any],
    *,
    first_loss: float = FIRST_LOSS,
    gradients: float = GRADIENTS,
) -> dict[str, float]:
    """``run`` and ``reference`` (:func:`trained`'s results) take the same first step: the loss before any update
    and the gradients it gives. Only the first step: after it, a last-bit difference of the two layouts' fp32 sums
    has flipped float8 roundings (an element moves by 1/8 in e4m3, 1/4 in e5m2), the tensorwise scales spread each
    flip over a whole tensor and AdamW turns near-zero gradients' flips into lr-sized steps, so the two runs part
    by up to 4e-3 in the loss from the second step on. How soon depends on how the CPU's kernels block their
    sums: with AVX-512 / AMX matmul kernels they part from the second step on, with others all five steps can stay
    within fp32's last bit. Later steps are compared with the same layout's runs (bitwise), not with one process.
    Returns the gradient differences."""
    assert abs(run["losses"][0] - reference["losses"][0]) <= first_loss, (run["losses"], reference["losses"])
    differences = gradient_differences(run["grads"], reference["grads"])
    assert max(differences.values()) < gradients, differences
    return differences


def trained(model: nn.Module, ranks: range = range(1), world: int = 1, **options: Any) -> dict[str, Any]:
    """:func:`train`'s losses, its first gradients, the parameters after its first step (``"first step"``: where
    an MoE's routing, which later float8 roundings can flip, has not yet parted two runs) and those it ends with."""
    grads: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}

    def after(step: int) -> None:
        if step == 0:
            first.update(full_parameters(model))

    losses = train(model, ranks, world, first_grads=grads, after_step=after, **options)
    return {"losses": losses, "grads": grads, "first step": first, "params": full_parameters(model)}


def convert_by_hand(blocks: Iterable[nn.Module], recipe: str | None) -> None:
    """torchao's own conversion of each block with the default filter: the one-process references' float8."""
    if recipe is None:
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for block in blocks:
        convert_to_float8_training(
            block, module_filter_fn=fp8_linear_filter, config=Float8LinearConfig.from_recipe_name(recipe)
        )


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


def record_attention_input(norm: nn.Module, attention: nn.Module) -> dict[str, Any]:
    """Filled by every forward: the amax of ``norm``'s first output (the attention's input before any gather),
    how often ``attention`` received its hidden states (first positional argument or ``hidden_states=``) as
    torchao's float8 (cast before tp's gather), and the first such scale."""
    seen: dict[str, Any] = {"float8 inputs": 0}

    def norm_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.setdefault("amax", float(output.detach().abs().max()))

    def attention_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        local = hidden.to_local() if hasattr(hidden, "to_local") else hidden
        if type(local).__name__ == "Float8TrainingTensor":  # torchao's float8 gather: scale and all
            seen["float8 inputs"] += 1
            seen.setdefault("scale", float(local._scale))

    norm.register_forward_hook(norm_output)
    attention.register_forward_pre_hook(attention_input, with_kwargs=True)
    return seen


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
