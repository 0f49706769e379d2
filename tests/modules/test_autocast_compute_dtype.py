"""Under autocast (bf16-mixed without FSDP) the blocks compute in bf16 as under FSDP's mixed precision: the
embedding's output and the norms' weights are cast, so no fp32 residual stream runs through the layers."""

from __future__ import annotations

import torch

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules import RMSNorm


def _layer_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        for layer in model.model.layers.values()
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    for hook in hooks:
        hook.remove()
    return seen


def test_the_residual_stream_is_bf16_under_autocast() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    for model in (
        Qwen3ForCausalLM(Qwen3Config.tiny(vocab_size=128)),
        Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(vocab_size=128)),
    ):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert set(_layer_inputs(model, ids)) == {torch.bfloat16}, type(model).__name__


def test_norm_weight_in_the_compute_dtype_only_under_autocast() -> None:
    norm = RMSNorm(8)
    x = torch.randn(3, 8).bfloat16()
    assert norm(x).dtype == torch.float32  # bf16 x fp32 weight: promoted, as without FSDP's casting
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32


def _gradients_in_another_layout(module: torch.nn.Module, *inputs: torch.Tensor) -> list[str]:
    """The parameters whose gradient reaches AccumulateGrad in another layout than the parameter's, or as a view of
    a larger tensor: AccumulateGrad copies those into a gradient of their own, one extra pass over the bytes."""
    strays: list[str] = []

    def check(name: str, weight: torch.Tensor, grad: torch.Tensor) -> None:
        if (
            grad.stride() != weight.stride()
            or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()
        ):
            strays.append(name)

    for name, weight in module.named_parameters():
        weight.register_hook(lambda grad, name=name, weight=weight: check(name, weight, grad))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(*inputs)
    out.float().sum().backward()
    assert all(
        weight.grad is not None and weight.grad.dtype == torch.float32 for weight in module.parameters()
    )
    return strays


def test_gradients_arrive_in_their_parameters_layout_under_autocast() -> None:
    """Gate and up run as one concatenated grouped GEMM: their gradients must come back as contiguous tensors of
    their own, not strided views of the concatenation's fp32 gradient (which cost two expert-sized fp32 copies
    per layer and step: 2.7 ms of a 166 ms MoE step on an H100). The same for every parameter of both models."""
    from lightning_d9d.modules.moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8, gemm_backend="torch")
    assert _gradients_in_another_layout(experts, torch.randn(12, 16), torch.tensor([3, 0, 5, 4])) == []
    ids = torch.randint(0, 128, (2, 16))
    for model in (
        Qwen3ForCausalLM(Qwen3Config.tiny(vocab_size=128)),
        Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(vocab_size=128)),
    ):
        assert _gradients_in_another_layout(model, ids) == [], type(model).__name__
