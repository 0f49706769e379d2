"""The plan options both strategies take (``D9DStrategy`` for the Trainer, ``D9DFabricStrategy`` for Fabric),
checked in one place: the same arguments refuse the same way under either, before any process starts.

Two moments: :func:`checked_parallel_options` when the strategy is constructed (the arguments alone), and
:func:`check_options_on_device` once the accelerator is known (Lightning hands it to the strategy after
construction), still before any process group.
"""

from __future__ import annotations

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.context_attention import check_context_attention
from lightning_d9d.plans.async_tp import check_async_tp, check_async_tp_device
from lightning_d9d.plans.checkpointing import check_checkpointing_layout, checkpointing_kind
from lightning_d9d.plans.compile import compile_mode
from lightning_d9d.plans.expert_tensor import check_expert_tensor_parallel
from lightning_d9d.plans.fp8 import Fp8Filter, check_fp8, check_fp8_device, check_fp8_experts
from lightning_d9d.plans.lora import LoRA
from lightning_d9d.plans.options import ParallelOptions


def checked_parallel_options(
    dims: ParallelDims,
    *,
    owner: str,
    activation_checkpointing: bool | str,
    compile: bool | str,
    context_attention: str,
    reshard_after_forward: bool | None,
    fsdp_on_one_rank: bool,
    fp8: str | None,
    fp8_filter: Fp8Filter | None,
    fp8_experts: bool | None,
    async_tp: bool,
    lora: LoRA | None = None,
    expert_tensor_parallel: bool = False,
) -> ParallelOptions:
    """The options as given, each refused here when it cannot apply to the requested degrees (``dims``, not
    yet resolved against the world). ``mp_policy`` stays unset: it comes from the precision plugin, which the
    strategy gets later."""
    checkpointing_kind(activation_checkpointing)
    check_checkpointing_layout(activation_checkpointing, pp=dims.pp, ep=dims.ep)
    compile_mode(compile)
    check_lora(lora, fp8=fp8, fp8_experts=fp8_experts, tp=dims.tp, owner=owner)
    return ParallelOptions(
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        context_attention=check_context_attention(context_attention, owner=owner),
        fsdp_on_one_rank=fsdp_on_one_rank,
        fp8=check_fp8(fp8, owner=owner),
        fp8_filter=fp8_filter,
        fp8_experts=check_fp8_experts(fp8, fp8_experts, owner=owner),
        async_tp=check_async_tp(async_tp, tp=dims.tp, compile=compile, owner=owner),
        lora=lora,
        expert_tensor_parallel=check_expert_tensor_parallel(
            expert_tensor_parallel,
            tp=dims.tp,
            ep=dims.ep,
            lora_experts=lora is not None and lora.experts,
            fp8=fp8,
            fp8_experts=fp8_experts,
            owner=owner,
        ),
    )


def check_lora(lora: LoRA | None, *, fp8: str | None, fp8_experts: bool | None, tp: int, owner: str) -> None:
    """A ``LoRA`` config, and the options it cannot be combined with yet: with ``fp8`` the adapted layers' base
    matmul runs in float8 and the adapters in their own dtype (``plans/fp8.py``), under tp too with the rowwise
    recipe (torch's plain styles); not tensorwise under tp, where torchao's float8 styles hand the layer a float8
    input the adapter would read too; nor float8 experts with adapted experts."""
    if lora is None:
        return
    if not isinstance(lora, LoRA):
        raise TypeError(f"{owner}(lora=...) takes a lightning_d9d.LoRA, got {type(lora).__name__}")
    if fp8 == "tensorwise" and tp > 1:
        raise ValueError(
            f"{owner}(lora=..., fp8='tensorwise', tp={tp}): under tp torchao's float8 styles hand an adapted layer a "
            "float8 input, which its adapter cannot read; use fp8='rowwise' under tp (torch's plain styles, "
            "scales per tp shard), tensorwise at tp=1 (FSDP, pp, cp, ep), or fp8=None"
        )
    if fp8 is not None and fp8_experts is not False and lora.experts:
        raise ValueError(
            f"{owner}(lora=LoRA(experts=True), fp8_experts={fp8_experts!r}): the experts' adapters run beside "
            "bf16 grouped GEMMs only; keep fp8_experts=False (the default) or adapt the experts without fp8"
        )


def check_options_on_device(
    options: ParallelOptions, dims: ParallelDims, device_type: str, *, owner: str
) -> None:
    """What the accelerator decides: async TP and some FP8 layouts run on CUDA only."""
    check_async_tp_device(options.async_tp, device_type, owner=owner)
    check_fp8_device(
        options.fp8, tp=dims.tp, device_type=device_type, owner=owner, fp8_experts=options.fp8_experts
    )
