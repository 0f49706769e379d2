"""FP8 training of the repeated blocks' linear layers through torchao's float8 training (an optional extra).

Each selected ``nn.Linear`` becomes torchao's ``Float8Linear``: its forward and both backward matmuls run in
float8 with dynamic scales (the master weights, the optimizer and the rest of the model stay as they were).
Two recipes:

- ``"tensorwise"``: one scale per tensor; the fastest on Hopper. Under FSDP2 the weights are cast to float8
  *before* the all-gather (``enable_fsdp_float8_all_gather``), so the gather moves half the bytes of bf16; not
  where tp splits the weights too (:func:`gathers_weights_in_float8`: the scales would be per tp shard).
- ``"rowwise"``: one scale per row (per token of the activations, per output channel of the weights), more
  robust to outliers; torchao's recommended recipe for accuracy, gathered in bf16 under FSDP2.

What is converted (:func:`fp8_linear_filter`, which a user may replace): the linear layers inside the repeated
blocks (attention projections, dense and shared-expert MLPs, the per-expert linears of a transformers MoE that
keeps them as modules) whose both dimensions divide by 16, as float8 matmuls require. Not the embedding, the LM
head (outside the blocks: its logits feed the loss, where precision matters most), and not routers (a linear named
``gate`` or ``router``, as AFMoE's ``mlp.router.gate``: their top-k choice is discontinuous, and they are small;
Qwen3-MoE's and Mixtral's routers in transformers 5 are no ``nn.Linear``).

Our MoE models' grouped experts (:class:`~lightning_d9d.modules.moe.GroupedExperts`), and a transformers MoE's
stacked experts (``gate_up_proj [E, 2 * ffn, hidden]``, ``down_proj``: 3-D parameters, which the transformers
adapter offers to this plan, ``models/hf/expert.offer_experts_to_float8``), are not ``nn.Linear``s:
:func:`convert_experts_to_float8` points them at the ``torchao_fp8`` grouped GEMM backend
(:mod:`lightning_d9d.kernels.grouped_gemm_fp8`: torchao's float8 rowwise grouped GEMM, forward and both backward
products), under either recipe, since torchao's grouped GEMM is rowwise only. A backend, not torchao's
tensor-subclass conversion of the weights: the experts reach their GEMMs through our registry (a transformers
model's through the adapter's forward, which replaces transformers' own where they train in float8), not through
``torch._grouped_mm`` on the parameters, and plain parameters leave FSDP2, ep's ``DTensor``s, the checkpoints and
the Hugging Face mapping as they are (a subclass would have to survive each). Only on CUDA with compute
capability 9.0+ and torchao's MoE package (:func:`fp8_experts_blocker`, :func:`choose_fp8_experts`, pure):
elsewhere the experts stay in bf16 with one log line, unless ``fp8_experts=True`` asked for them (then refused).

Applied first, before tensor parallelism, checkpointing, compile and FSDP (``plans.blocks.convert_blocks_to_float8``,
which each model's plan calls before its tp plan; ``parallelize_blocks`` converts what a plan left unconverted): the
conversion swaps modules, tp's styles must find the float8 linears to cast around them, and compile must see the
float8 casts to fuse them. (Checkpointing's wrapper and ``Module.compile``, which traces at the first call, would
also take linears converted after them: the order is load-bearing for tp and FSDP, which split the weights.)

Under tp (:func:`float8_tensor_plan`, applied by ``parallelize_tensor``): a tensorwise ``Float8Linear`` gets
torchao's float8 styles in place of torch's column- and row-parallel ones, and a block's sequence gather becomes
a float8 gather where every column-parallel linear it feeds is converted (torch's ``PrepareModuleInput`` becomes
torchao's ``PrepareFloat8ModuleInput``; a model's own gather style, as the transformers adapter's, says how through
:class:`Float8InputGather`). The activations are cast *before* the
sequence all-gather and the gradients before their reduce, so tp's collectives move float8 and each scale is
the amax of the whole (DTensor) tensor: the same scales as one process. gloo has no float8 type: tp's float8
gathers run on NCCL (the CPU tests move them as bytes).

A rowwise ``Float8Linear`` under tp keeps torch's plain column- and row-parallel styles (torchao's float8 styles
take one scale per tensor), as torchtitan runs it: the sequence gather moves bf16, and each rank casts its local
operands, so where tp splits a product's contraction dim the rowwise scales are taken per shard. A
column-parallel linear's grad_input contracts over its output features, which tp splits: it is the sum over tp of
products whose grad_output and weight rows are each scaled over this rank's features only. A row-parallel
linear's output contracts over its split input features: the input's and the weight's rows are scaled per shard.
The other products (a column-parallel linear's output and grad_weight, a row-parallel one's grad_input and
grad_weight) contract over a dim every rank holds whole, and are one process's bitwise. So rowwise at tp=N trains
what one process does when each float8 linear multiplies per block of N (``tests/plans/test_fp8.py``: losses
within 2 fp32 last bits over 5 steps), not the one-process rowwise model: at tp=2 on the tiny Qwen3 1.2e-5 apart
in the first loss and 6e-3 in the parameters after 5 AdamW steps at lr=1e-3, float8 rounding that differs, not a
bias. A shard's amax is at most its row's, so no element is scaled more coarsely than one process scales it. LoRA's
adapted layers (``Float8LoRALinear``) take the same plain styles, their adapters split beside the base
(``plans/lora.lora_tensor_plan``) and reading the input as it is; tensorwise adapted layers under tp are refused
(torchao's float8 styles would hand their adapters a float8 input). On
a transformers Qwen3 (``tests/models/hf/test_hf_fp8.py``) the per-shard model holds for the first step only: after
it any two rowwise runs whose fp32 sums differ in their last bits part, since a row's power-of-two scale re-rounds
the whole row when its amax crosses a power of two.


Compositions proven on CPU, each against one process with torchao's conversion applied by hand
(``tests/plans/test_fp8.py``, ``tests/plans/test_fp8_compositions.py``; the tiny Qwen3, 5 AdamW steps, losses,
first gradients and parameters): FSDP (dp_shard=2); tp=2; activation recompute, full and selective (bitwise:
the recompute casts the same tensors; selective keeps the float8 matmuls' outputs, which reach its policy as
``aten.mm``); compile=True with selective recompute (bitwise through the plan on ``aot_eager``, one graph for both
blocks with the casts inside; Inductor compiles torchao's float8 casts on CPU into its own C++ kernels, bitwise
eager's on a float8 block; the tiny Qwen3 with its blocks compiled by Inductor has eager's first loss and its first
gradients within 9e-7 of their largest entries, as the fp32 model has: measured, not in CI, whose 2 cores take half
a minute to generate the code); FSDP x tp (dp_shard=2 x tp=2: tensorwise one
process's first step and tp alone's run bitwise, rowwise one process's with per-shard scales); cp=2 (each cp
rank's linears scale over its own positions, as a data-parallel rank's over its rows: one process whose linears
multiply each rank's positions on their own, within fp32's last bits); pp=2 (each stage converts its block; 1F1B
bitwise one process running the microbatches one after the other); HSDP (dp_replicate=2 x dp_shard=2, both
recipes: each data rank's rows scaled on their own, within fp32's last bits; tensorwise's float8 all-gather takes
its amax over the shard mesh only, which holds the whole weight in each replica: one process's scale). Our
Qwen3-MoE (its float8 linears: attention and the dense layers; the experts bf16 off the GPU, the router
unconverted) under tp=2 (tensorwise against one process on the whole batch, rowwise against one process scaling
per tp shard: the first steps within fp32's last bits, later ones up to 5.5e-4 apart in the loss, measured, where
float8 rounding that a last bit flipped has moved AdamW's steps enough to flip a few tokens' top-2 choice; the fp32
MoE under tp flips none), ep=2 (each data rank's rows on their own, within fp32's last bits over 5 steps) and
ep=2 x tp=2 (both recipes: each data rank's rows, tp's scales as under tp alone; the first steps within fp32's last
bits, then routing flips). Full recompute of compiled blocks under tp=2 (which compiles before it checkpoints, so
backward re-runs each compiled forward): tensorwise, bitwise the eager tp run, the first step within fp32's last
bits of one process. A transformers Qwen3-MoE under tp=2 (``tests/models/hf/test_hf_fp8.py``): both recipes as our
Qwen3-MoE's (rowwise within fp32's last bits over 5 steps; tensorwise until routing flips at step 3)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from lightning_d9d.kernels.grouped_gemm_fp8 import (
    FLOAT8_BACKEND,
    FP8_GROUP_ALIGNMENT,
    MIN_CAPABILITY,
    load_torchao_fp8,
    torchao_fp8_importable,
)
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe.experts import GroupedGemmExperts

FP8_RECIPES = ("tensorwise", "rowwise")
Fp8Filter = Callable[[nn.Module, str], bool]
log = logging.getLogger("lightning_d9d.plans")
_FLOAT8_LINEAR = "torchao.float8.float8_linear"  # imported once anything is converted


def check_fp8(recipe: str | None, *, owner: str) -> str | None:
    """Refuse an unknown recipe, or one without torchao installed, before any process group. Both recipes compose
    with tp (module docstring: rowwise takes its scales per tp shard where tp splits a contraction)."""
    if recipe is None:
        return None
    if recipe not in FP8_RECIPES:
        raise ValueError(
            f"{owner}: fp8={recipe!r}; choose one of {', '.join(map(repr, FP8_RECIPES))}, or None"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            f"{owner}: fp8={recipe!r} needs torchao's float8 training: pip install 'lightning-d9d[fp8]' (or "
            "torchao), or leave fp8=None"
        )
    return recipe


def check_fp8_device(
    recipe: str | None, *, tp: int, device_type: str, owner: str, fp8_experts: bool | None = None
) -> None:
    """Refuse tensorwise FP8 under tp off CUDA, before any process group: torchao's float8 tp styles all-gather
    float8 tensors, which gloo has no type for (it fails inside the first forward, "Invalid scalar type"). And
    ``fp8_experts=True`` off CUDA (the float8 grouped GEMM runs on CUDA only; the GPU's capability is checked
    by the plan)."""
    if fp8_experts and device_type != "cuda":
        raise ValueError(
            f"{owner}: fp8_experts=True on {device_type!r}: torchao's float8 grouped GEMM runs on CUDA GPUs of "
            "compute capability 9.0 or newer; leave fp8_experts=None (the experts then stay in bf16 off CUDA)"
        )
    if recipe == "tensorwise" and tp > 1 and device_type != "cuda":
        raise ValueError(
            f"{owner}: fp8='tensorwise' with tp={tp} on {device_type!r}: tp's float8 all-gathers need NCCL (gloo has "
            "no float8 type); use CUDA GPUs, tp=1 (FSDP, cp, ep and pp compose), or fp8=None on CPU"
        )


def check_fp8_experts(recipe: str | None, fp8_experts: bool | None, *, owner: str) -> bool | None:
    """Refuse ``fp8_experts=True`` without an ``fp8`` recipe, before any process group (the experts' float8 is
    part of the FP8 plan: it needs ``fp8`` on)."""
    if fp8_experts and recipe is None:
        raise ValueError(
            f"{owner}: fp8_experts=True needs fp8='rowwise' or 'tensorwise' (the experts train in float8 as part "
            "of the FP8 plan); set fp8, or leave fp8_experts=None"
        )
    return fp8_experts


def fp8_experts_blocker(
    *, device_type: str, capability: tuple[int, int] | None, torchao_moe: bool
) -> str | None:
    """Why the grouped experts cannot train in float8 on this device (``None``: they can). Pure: the caller
    reads the device (``capability``: the CUDA device's, ``None`` off CUDA) and whether torchao's MoE training
    package is installed."""
    if device_type != "cuda":
        return f"the model runs on {device_type!r} and torchao's float8 grouped GEMM runs on CUDA only"
    if capability is None or capability < MIN_CAPABILITY:
        found = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (
            f"torchao's float8 grouped GEMM needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"(Hopper) or newer, this GPU has {found}"
        )
    if not torchao_moe:
        return "this torchao has no torchao.prototype.moe_training (its float8 grouped GEMM)"
    return None


def choose_fp8_experts(recipe: str | None, fp8_experts: bool | None, blocker: str | None) -> bool:
    """Whether the FP8 plan trains the grouped experts in float8: with a ``recipe`` (either: torchao's grouped
    GEMM is rowwise only, which the experts take under both), unless ``fp8_experts=False``, where nothing
    blocks it (``blocker``, from :func:`fp8_experts_blocker`). A blocker refuses ``fp8_experts=True`` (asked
    explicitly) and leaves the default (``None``) in bf16."""
    if recipe is None or fp8_experts is False:
        return False
    if blocker is None:
        return True
    if fp8_experts:
        raise ValueError(f"fp8_experts=True: {blocker}; use CUDA GPUs of compute capability 9.0 or newer")
    return False


def experts_fp8_shape_blocker(experts: GroupedGemmExperts) -> str | None:
    """Why these experts' widths do not fit the float8 grouped GEMM (``None``: they do): both GEMMs contract
    and produce multiples of 16 (hidden, and the expert width, whole on every rank: tp does not split them)."""
    if experts.hidden_size % FP8_GROUP_ALIGNMENT or experts.intermediate_size % FP8_GROUP_ALIGNMENT:
        return (
            f"hidden ({experts.hidden_size}) and expert width ({experts.intermediate_size}) must be multiples of "
            f"{FP8_GROUP_ALIGNMENT}"
        )
    return None


# experts already decided on (the plan, then parallelize_blocks, both convert): one log line each
_DECIDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def convert_experts_to_float8(
    blocks: Sequence[nn.Module],
    recipe: str | None,
    fp8_experts: bool | None,
    *,
    device_type: str,
    capability: tuple[int, int] | None = None,
) -> int:
    """Point all experts in ``blocks`` that run their grouped GEMMs through the registry
    (:class:`~lightning_d9d.modules.moe.GroupedGemmExperts`: ours, a transformers model's where the adapter offers
    them) at the float8 grouped GEMM (``gemm_backend="torchao_fp8"``) where :func:`choose_fp8_experts` says so;
    returns how many run in float8.
    Where they cannot (off CUDA, before Hopper, without torchao's MoE package, widths not multiples of 16) they
    stay in bf16 with one INFO line, or, with ``fp8_experts=True``, the conversion is refused. ``capability``:
    the CUDA device's (read from the current device when ``None``)."""
    found = [m for block in blocks for m in block.modules() if isinstance(m, GroupedGemmExperts)]
    if recipe is None or fp8_experts is False or not found:
        return 0
    if capability is None and device_type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    blocker = fp8_experts_blocker(
        device_type=device_type, capability=capability, torchao_moe=torchao_fp8_importable()
    )
    use = choose_fp8_experts(recipe, fp8_experts, blocker)
    fresh = [m for m in found if m not in _DECIDED]
    _DECIDED.update(found)
    converted, skipped = 0, []
    for experts in found:
        reason = None if use else blocker
        reason = reason or experts_fp8_shape_blocker(experts)
        if reason is None and load_torchao_fp8() is None:  # found, but its import fails (no Triton, say)
            reason = "torchao.prototype.moe_training's float8 grouped GEMM cannot be imported"
        if reason is None:
            experts.gemm_backend = FLOAT8_BACKEND
            converted += 1
        elif fp8_experts:
            raise ValueError(f"fp8_experts=True: {reason}")
        elif experts in fresh:
            skipped.append(reason)
    if fresh and converted:
        log.info("fp8 (%s): %d grouped experts train in float8 (rowwise, torchao)", recipe, converted)
    if skipped:
        log.info("fp8 (%s): %d grouped experts stay in bf16: %s", recipe, len(skipped), skipped[0])
    return converted


def fp8_linear_filter(module: nn.Module, name: str) -> bool:
    """The default choice of linear layers to train in float8 (module docstring): dims divisible by 16, not a
    router. ``name`` is the module's name inside its block."""
    if not isinstance(module, nn.Linear):
        return False
    if name.rsplit(".", 1)[-1] in ("gate", "router"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _convert_adapted_layers(block: nn.Module, chosen: Fp8Filter, config: Any) -> int:
    """LoRA's adapted layers the filter accepts (as their base): the base weight's matmul in float8 (a
    ``Float8Linear`` with the adapter kept beside it, in its own dtype), the adapter untouched. Returns how many."""
    from lightning_d9d.modules.lora import LoRALinear

    adapted = [(name, layer) for name, layer in block.named_modules() if isinstance(layer, LoRALinear)]
    count = 0
    for name, layer in adapted:
        if isinstance(layer, _float8_lora_class()) or not chosen(layer, name):
            continue
        parent_name, _, child_name = name.rpartition(".")
        setattr(block.get_submodule(parent_name), child_name, float8_lora_linear(layer, config))
        count += 1
    return count


@functools.cache
def _float8_lora_class() -> type[nn.Module]:
    """``Float8LoRALinear``: torchao's ``Float8Linear`` for the base and ``LoRALinear``'s adapter beside it (made
    on first use: torchao is imported only when FP8 is on)."""
    from torchao.float8.float8_linear import Float8Linear

    from lightning_d9d.modules.lora import LoRALinear

    class Float8LoRALinear(Float8Linear, LoRALinear):  # type: ignore[misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            update = self.lora_B(self.lora_A(self.lora_dropout(x)))
            return Float8Linear.forward(self, x) + update * self.scaling

    return Float8LoRALinear


def float8_lora_linear(layer: nn.Module, config: Any) -> nn.Module:
    """``layer`` (a ``LoRALinear``) as a ``Float8LoRALinear``: torchao builds the float8 base around the same
    weight and bias, the adapter and its settings move over as they are."""
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(layer, nn.Linear)
    converted = Float8Linear.from_float(layer, config=config)
    converted.__class__ = _float8_lora_class()
    for attribute in ("lora_A", "lora_B", "lora_dropout"):
        setattr(converted, attribute, getattr(layer, attribute))
    for attribute in ("rank", "alpha", "scaling"):
        setattr(converted, attribute, getattr(layer, attribute))
    converted.train(layer.training)
    return converted


def gathers_weights_in_float8(recipe: str, *, fsdp: bool, tp: int) -> bool:
    """Whether FSDP2 all-gathers the float8 linears' weights in float8 (cast on each shard before the gather):
    tensorwise under FSDP, but not where tp splits the weights as well. torchao takes the amax of a float8
    all-gather over the FSDP mesh only, so under FSDP x tp each tp rank would scale its shard of a weight by that
    shard's own amax, where the whole (DTensor) weight has one amax on one process (on CPU at dp_shard=2 x tp=2:
    the tiny Qwen3's first gradients 0.18 of their largest entry off one process's, 5e-7 with the weights gathered
    in their own dtype). There the float8 linear casts the gathered tp shard as tp alone does, its amax reduced
    over tp: one process's scale, at the cost of gathering the weights in bf16."""
    return recipe == "tensorwise" and fsdp and tp == 1


def apply_fp8(
    blocks: Sequence[nn.Module],
    recipe: str,
    dims: ParallelDims,
    *,
    module_filter: Fp8Filter | None = None,
    fsdp: bool,
) -> int:
    """Convert the chosen linear layers of every block in ``blocks`` to float8 training in place; returns how many
    float8 linears the blocks hold. Linears converted by an earlier call stay as they are (a model's plan converts
    before its tp plan, ``parallelize_blocks`` again for plans that did not).

    ``fsdp``: whether FSDP2 will shard these blocks (then tensorwise casts before the all-gather, unless tp splits
    the weights too: :func:`gathers_weights_in_float8`)."""
    check_fp8(recipe, owner="apply_fp8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config: Any = Float8LinearConfig.from_recipe_name(recipe)
    if gathers_weights_in_float8(recipe, fsdp=fsdp, tp=dims.tp):  # the recipe's casts, gathered in float8
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = module_filter or fp8_linear_filter
    converted = 0

    def counted(module: nn.Module, name: str) -> bool:
        nonlocal converted
        # a Float8Linear is an nn.Linear too: never wrap one twice; LoRA's adapters stay in their dtype
        if ".lora_" in f".{name}" or isinstance(module, Float8Linear):
            return False
        take = chosen(module, name)
        if take and isinstance(getattr(module, "weight", None), DTensor):
            # sharded by tp already: a new module would drop tp's hooks (a Tensor meets a DTensor in forward)
            raise RuntimeError(
                f"fp8={recipe!r}: {name} is already split by a tensor-parallel plan; convert the blocks first "
                "(lightning_d9d.plans.convert_blocks_to_float8 before parallelize_tensor), as our models' plans do"
            )
        converted += int(take and isinstance(module, nn.Linear))
        return take

    for block in blocks:
        converted += _convert_adapted_layers(block, chosen, config)
        convert_to_float8_training(block, module_filter_fn=counted, config=config)
    held = sum(isinstance(m, Float8Linear) for block in blocks for m in block.modules())
    if held == 0:
        raise ValueError(
            f"fp8={recipe!r}: no linear layer of the model's blocks was chosen (both dims must divide by 16, "
            "and the filter must accept it); leave fp8=None, or pass a module filter that selects some"
        )
    if converted:
        log.info("fp8 (%s): %d linear layers train in float8", recipe, converted)
    return held


def float8_tensor_plan(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` (module name -> style, relative to ``module``) with torchao's float8 styles where its targets are
    tensorwise ``Float8Linear``s: column- and row-parallel linears get ``Float8ColwiseParallel`` /
    ``Float8RowwiseParallel`` with the same layouts, and a ``PrepareModuleInput`` (a block's sequence gather)
    becomes ``PrepareFloat8ModuleInput`` when every column-parallel linear directly inside it is one (they are
    what its gathered input feeds; a bf16 consumer would receive float8). Without float8 linears, ``plan``."""
    if _FLOAT8_LINEAR not in sys.modules:  # nothing was converted: no need to import torchao
        return dict(plan)
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def tensorwise(name: str) -> bool:
        target = module.get_submodule(name)
        return (
            isinstance(target, Float8Linear)
            and target.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
        )

    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and tensorwise(name):
            _refuse_adapted(module.get_submodule(name), name)
            kind = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            out[name] = kind(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        else:
            out[name] = style
    for name, style in plan.items():
        if type(style) is not PrepareModuleInput and not isinstance(style, Float8InputGather):
            continue
        inside = [
            key
            for key, child in plan.items()
            if key.startswith(f"{name}.")
            and "." not in key[len(name) + 1 :]
            and isinstance(child, ColwiseParallel)
        ]
        if not inside or not all(tensorwise(key) for key in inside):
            continue
        if isinstance(style, Float8InputGather):  # a model's own gather (the transformers adapter's)
            out[name] = style.in_float8()
            continue
        # the input is cast once, before the all-gather, and every projection reuses it; torchao's
        # float8 styles take it as a DTensor (use_local_output=False), as torchtitan runs them
        out[name] = PrepareFloat8ModuleInput(
            input_layouts=style.input_layouts,
            desired_input_layouts=style.desired_input_layouts,
            use_local_output=False,
        )
    return out


def _refuse_adapted(layer: nn.Module, name: str) -> None:
    """A tensorwise ``Float8LoRALinear`` under tp: torchao's float8 styles cast its input to float8 (before the
    sequence gather), which its adapter would then read; the rowwise recipe keeps torch's plain styles, under which
    the adapter reads the input as it is."""
    if isinstance(layer, _float8_lora_class()):
        raise ValueError(
            f"fp8='tensorwise' under tp: {name} is adapted by LoRA, and torchao's float8 tp styles hand it a float8 "
            "input its adapter cannot read; use fp8='rowwise' under tp (torch's plain styles, scales per tp "
            "shard), or tensorwise at tp=1"
        )


@runtime_checkable
class Float8InputGather(Protocol):
    """A tp style of a model's own that all-gathers a module's input for the column-parallel linears inside it
    (the transformers adapter's ``HiddenStatesLayout``: its layers call their regions by keyword or by position,
    which torch's ``PrepareModuleInput`` cannot take both of). Where every such linear is a tensorwise
    ``Float8Linear``, :func:`float8_tensor_plan` swaps in :meth:`in_float8`, as it swaps ``PrepareModuleInput``
    for torchao's ``PrepareFloat8ModuleInput``."""

    def in_float8(self) -> ParallelStyle:
        """The same gather, casting the input to float8 before it (:func:`float8_input_cast`) and handing the
        module the gathered ``DTensor`` of float8 data, which torchao's float8 styles take without a second cast."""
        ...


def float8_input_cast(module: nn.Module) -> Callable[[DTensor], DTensor]:
    """The cast every tensorwise ``Float8Linear`` inside ``module`` applies to its input, as one function of a
    (sequence-sharded) ``DTensor``: one scale, the amax of the whole tensor (a max over the shards), so a gather
    after it moves float8 and each linear reuses the cast, with one process's scale. The linears must cast alike
    (same float8 dtype, matmul config and scale rounding), as torchao's ``PrepareFloat8ModuleInput`` asks."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    casts = {
        (
            linear.linear_mm_config,
            linear.config.cast_config_input.target_dtype,
            linear.config.round_scales_to_power_of_2,
        )
        for linear in module.modules()
        if isinstance(linear, Float8Linear)
    }
    if len(casts) != 1:
        raise ValueError(
            f"float8 input gather of {type(module).__name__}: its float8 linears cast their inputs in "
            f"{len(casts)} ways; convert them with one recipe, or keep the gather in high precision"
        )
    ((mm_config, dtype, power_of_2),) = casts

    def cast(tensor: DTensor) -> DTensor:
        float8: Any = hp_tensor_to_float8_dynamic(
            tensor,
            dtype,
            mm_config,
            gemm_input_role=GemmInputRole.INPUT,
            round_scales_to_power_of_2=power_of_2,
        )
        return float8

    return cast
