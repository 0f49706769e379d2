"""transformers' RMSNorms (q/k norms included) swapped for our rms_norm and its SwiGLU MLPs for our swiglu: same
logits and gradients as the unswapped model (CPU fp32 and bf16), every norm and MLP counted, parameter names and
objects unchanged, off by the switch, and a norm or MLP of other semantics left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from lightning_d9d.models.hf.kernels import ENV_VAR, SWAPPED, swap_hf_kernels

FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}
LAYERS = 2
NORMS_PER_LAYER = {"qwen3": 4, "llama": 2}  # input / post-attention norms, Qwen3's q/k norms


def tiny_model(family: str) -> nn.Module:
    config_class, model_class = FAMILIES[family]
    config = config_class(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # norms' weights away from ones, so that the weight's part is tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.train()
    return model


def logits_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.float().pow(2).mean() + logits[..., 3].sum()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_modules_match_transformers(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    names = [name for name, _ in model.named_parameters()]
    params = {name: p for name, p in model.named_parameters()}
    norms = {name for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")}
    mlps = {name for name, module in model.named_modules() if type(module).__name__.endswith("MLP")}

    swapped = swap_hf_kernels(model)

    assert len(norms) == NORMS_PER_LAYER[family] * LAYERS + 1
    assert mlps == {f"model.layers.{i}.mlp" for i in range(LAYERS)}
    assert set(swapped) == norms | mlps
    if family == "qwen3":
        assert {
            f"model.layers.{i}.self_attn.{n}" for i in range(LAYERS) for n in ("q_norm", "k_norm")
        } <= norms
    modules = dict(model.named_modules())
    assert all(getattr(modules[name], SWAPPED) == "rms_norm" for name in norms)
    assert all(getattr(modules[name], SWAPPED) == "swiglu" for name in mlps)
    assert [name for name, _ in model.named_parameters()] == names
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert swap_hf_kernels(model) == []  # once only

    expected_logits, expected_grads = logits_and_grads(reference)
    logits, grads = logits_and_grads(model)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("value", ["0", "off"])
def test_switched_off(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    model = tiny_model("qwen3")
    assert swap_hf_kernels(model) == []
    assert not any(hasattr(module, SWAPPED) or "forward" in vars(module) for module in model.modules())


def test_bad_switch_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        swap_hf_kernels(tiny_model("llama"))


class LateCastRMSNorm(nn.Module):
    """The weight applied before the cast back (T5's order): other numbers in bf16, not swapped."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (
            self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        ).to(x.dtype)


class OffsetRMSNorm(LateCastRMSNorm):
    """``1 + weight`` (Gemma's): not swapped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * normed.to(x.dtype)


class PlainRMSNorm(OffsetRMSNorm):
    """The same numbers as transformers' norms under another class: swapped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * normed.to(x.dtype)


class GatedMLP(nn.Module):
    """A SwiGLU MLP by its forward; its subclasses change the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn: nn.Module = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(GatedMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act_fn = nn.GELU()


class UpGatedMLP(GatedMLP):
    """The activation on up instead of gate: other numbers, not swapped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


def test_only_matching_mlps_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    model = nn.ModuleDict({"silu": GatedMLP(), "gelu": GeluMLP(), "up": UpGatedMLP()})
    reference = copy.deepcopy(model)
    assert swap_hf_kernels(model) == ["silu"]
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(model["silu"](x), reference["silu"](x), rtol=0, atol=0)


def test_only_matching_semantics_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    model = nn.ModuleDict(
        {
            "late": LateCastRMSNorm(8),
            "offset": OffsetRMSNorm(8),
            "plain": PlainRMSNorm(8),
            "ln": nn.LayerNorm(8),
        }
    )
    assert swap_hf_kernels(model) == ["plain"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_cast_order(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 the normalised value is rounded before the weight is applied: the same numbers as transformers'."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference = tiny_model(family).to(torch.bfloat16)
    model = copy.deepcopy(reference)
    swap_hf_kernels(model)
    expected_logits, expected_grads = logits_and_grads(reference)
    logits, grads = logits_and_grads(model)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=name)
