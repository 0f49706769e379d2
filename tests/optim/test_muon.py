"""Muon in one process: the Newton–Schulz iteration against its polynomial, an SVD and a plain implementation,
the learning-rate scaling, the parameter split, and steps against ``torch.optim.Muon`` + ``torch.optim.AdamW``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.optim import Muon, default_muon_rule, muon_param_groups, newton_schulz
from lightning_d9d.optim.muon import NS_COEFFICIENTS, NS_STEPS, lr_scale

# wide, tall, square-ish, and a stack of experts: rectangular Gaussians (aspect 2) are well conditioned, so every
# normalised singular value is large enough to reach the band in five steps
SHAPES = [(32, 64), (64, 32), (48, 96), (4, 32, 64)]


def random_matrix(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def quintic(s: Tensor, steps: int = NS_STEPS) -> Tensor:
    """What the iteration does to each singular value: ``a s + b s^3 + c s^5``, ``steps`` times."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def plain_newton_schulz(matrix: Tensor) -> Tensor:
    """The iteration written out for one matrix in float64, without transposes or fused ops."""
    x = matrix.double() / matrix.double().norm()
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x
        if x.shape[0] <= x.shape[1]:
            x = a * x + b * gram @ x + c * gram @ gram @ x
        else:
            x = a * x + b * x @ gram + c * x @ gram @ gram
    return x


def normalised_singular_values(matrix: Tensor) -> Tensor:
    return (
        torch.linalg.svdvals(matrix.double())
        / torch.linalg.matrix_norm(matrix.double(), keepdim=True)[..., 0]
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_are_the_quintic_of_the_normalised_ones(shape: tuple[int, ...]) -> None:
    """The iteration maps each singular value of ``G / |G|_F`` by the polynomial five times (sorted: the
    polynomial is not monotonic)."""
    matrix = random_matrix(shape)
    result = newton_schulz(matrix)
    expected = quintic(normalised_singular_values(matrix)).sort(dim=-1).values
    got = torch.linalg.svdvals(result.double()).sort(dim=-1).values
    assert torch.allclose(got, expected, atol=1e-5)


def quintic_band(smallest: float) -> tuple[float, float]:
    """Where five steps take any singular value in ``[smallest, 1]``: the band the iteration ends in."""
    grid = quintic(torch.linspace(smallest, 1.0, 200_001, dtype=torch.float64))
    return float(grid.min()), float(grid.max())


@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_end_in_the_band_the_coefficients_give(shape: tuple[int, ...]) -> None:
    matrix = random_matrix(shape, seed=1)
    low, high = quintic_band(float(normalised_singular_values(matrix).min()))
    # Keller Jordan's coefficients do not converge to 1: they oscillate in about [0.68, 1.2]
    assert 0.6 < low < 0.75 and 1.1 < high < 1.25
    singular = torch.linalg.svdvals(newton_schulz(matrix).double())
    assert low - 1e-5 <= float(singular.min()) and float(singular.max()) <= high + 1e-5
    # so the result is U V^T of the SVD up to the band's width (same singular vectors), in spectral norm
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    distance = torch.linalg.matrix_norm(newton_schulz(matrix).double() - u @ vh, ord=2)
    assert float(distance.max()) <= max(1 - low, high - 1) + 1e-5


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_fp32_iteration_matches_a_plain_implementation(shape: tuple[int, ...]) -> None:
    matrix = random_matrix(shape, seed=2)
    assert torch.allclose(newton_schulz(matrix).double(), plain_newton_schulz(matrix), atol=2e-6)


def test_bf16_iteration_is_torch_muons_and_stacks_go_expert_by_expert() -> None:
    for shape in SHAPES[:3]:
        matrix = random_matrix(shape, seed=3)
        ours = newton_schulz(matrix, dtype=torch.bfloat16)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, NS_STEPS, 1e-7).float())
    stack = random_matrix((4, 32, 64), seed=4)
    each = torch.stack([newton_schulz(expert) for expert in stack])
    assert torch.allclose(newton_schulz(stack), each, atol=1e-6)
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4))  # no division by zero


@pytest.mark.parametrize("shape", [(64, 64), (128, 64), (64, 128), (8, 32, 64), (8, 64, 32)])
def test_lr_scaling_formulas(shape: tuple[int, ...]) -> None:
    rows, cols = shape[-2:]
    assert lr_scale(shape, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(max(rows, cols)))
    assert lr_scale(shape, "original") == pytest.approx(max(1.0, rows / cols) ** 0.5)
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        lr_scale(shape, "unknown")  # type: ignore[arg-type]


def test_default_rule_takes_the_decoder_blocks_matrices_only() -> None:
    dense = Qwen3ForCausalLM(Qwen3Config.tiny())
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())
    dense_muon = {n for n, p in dense.named_parameters() if default_muon_rule(n, p)}
    moe_muon = {n for n, p in moe.named_parameters() if default_muon_rule(n, p)}
    assert "model.layers.0.self_attn.q_proj.weight" in dense_muon
    assert "model.layers.1.mlp.down_proj.weight" in dense_muon
    assert "model.layers.0.mlp.experts.gate_up_proj" in moe_muon  # [E, in, out]: per expert
    for excluded in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert excluded not in dense_muon
    assert "model.layers.0.mlp.gate.weight" not in moe_muon  # the router
    groups = muon_param_groups(dense)
    assert [group["use_muon"] for group in groups] == [True, False]
    assert sum(len(group["params"]) for group in groups) == len(list(dense.parameters()))
    only_attention = muon_param_groups(dense, lambda name, param: "self_attn" in name and param.ndim == 2)
    assert len(only_attention[0]["params"]) == 4 * dense.config.num_hidden_layers


def test_refuses_what_it_cannot_orthogonalise() -> None:
    with pytest.raises(ValueError, match=r"got a parameter of shape \(8,\) in a use_muon group"):
        Muon([torch.nn.Parameter(torch.ones(8))])
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        Muon([torch.nn.Parameter(torch.ones(8, 8))], lr_scaling="spectral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ns_dtype must be a floating dtype"):
        Muon([torch.nn.Parameter(torch.ones(8, 8))], ns_dtype="int8")


def batches(vocab: int, count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, vocab, (2, 8), generator=generator),
            torch.randint(0, vocab, (2, 8), generator=generator),
        )
        for _ in range(count)
    ]


def train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
    for ids, labels in batches(256, steps):
        causal_lm_loss(model(ids), labels).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_steps_are_torch_muon_and_torch_adamw() -> None:
    """With torch.optim.Muon's bf16 iteration and Keller Jordan's scaling, five steps on tiny Qwen3 are exactly
    those of torch.optim.Muon on the blocks' matrices and torch.optim.AdamW on the rest."""
    torch.manual_seed(0)
    ours = Qwen3ForCausalLM(Qwen3Config.tiny())
    theirs = Qwen3ForCausalLM(Qwen3Config.tiny())
    theirs.load_state_dict(ours.state_dict())
    options = {"lr": 1e-2, "weight_decay": 0.1}
    train(ours, [Muon(muon_param_groups(ours), ns_dtype=torch.bfloat16, lr_scaling="original", **options)], 5)
    muon_group, adamw_group = muon_param_groups(theirs)
    torch_optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Muon(muon_group["params"], adjust_lr_fn="original", **options),
        torch.optim.AdamW(adamw_group["params"], foreach=False, **options),
    ]
    train(theirs, torch_optimizers, 5)
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, other), name


def test_an_empty_step_at_lr_zero_changes_nothing() -> None:
    """DCP builds an optimizer's state before loading into it with one step of zero gradients at lr 0."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = Muon(muon_param_groups(model), lr=0.0)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    experts = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    assert set(optimizer.state[experts]) == {"momentum_buffer"}
    assert set(optimizer.state[model.get_parameter("lm_head.weight")]) == {"step", "exp_avg", "exp_avg_sq"}
