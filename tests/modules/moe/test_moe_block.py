"""The MoE block equals a dense per-token reference (forward and gradients, fp32, 1e-5) and transformers'
Qwen3-MoE block with the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lightning_d9d.modules.moe import MoE


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # of the input, hidden last
    experts: int
    top_k: int
    ffn: int
    normalize: bool = False
    bias: bool = False
    shared: int | None = None
    backend: str = "loop"
    aux: float = 0.0
    z: float = 0.0
    expect_idle_expert: bool = True


CASES = [
    # torch's grouped_mm needs 16-byte rows: hidden and ffn multiples of 4 in fp32
    Case((3, 5, 12), experts=9, top_k=2, ffn=20, normalize=True, shared=8, backend="torch", bias=True),
    Case((1, 13, 7), experts=11, top_k=3, ffn=13, aux=0.01, z=0.001, bias=True),
    Case((2, 2, 6), experts=16, top_k=2, ffn=5),  # 8 slots for 16 experts: at least 8 experts get none
    Case((6, 10), experts=3, top_k=3, ffn=9, normalize=True, expect_idle_expert=False),  # every expert
]


def _block(case: Case) -> MoE:
    torch.manual_seed(sum(case.shape) + case.experts)
    moe = MoE(
        case.shape[-1],
        case.experts,
        case.top_k,
        case.ffn,
        normalize_top_k=case.normalize,
        selection_bias=case.bias,
        shared_intermediate_size=case.shared,
        aux_loss_coef=case.aux,
        z_loss_coef=case.z,
        gemm_backend=case.backend,
    )
    if moe.gate.expert_bias is not None:
        with torch.no_grad():
            moe.gate.expert_bias.normal_(0.0, 0.1)
            moe.gate.expert_bias[0] = -10.0  # never chosen: an expert with no token
    return moe


def dense_reference(moe: MoE, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token: sum over its top-k experts of weight * SwiGLU_expert(token), expert by expert; and
    the router loss written out from its definition."""
    tokens = hidden.reshape(-1, hidden.shape[-1])
    logits = tokens @ moe.gate.weight.T
    probs = torch.softmax(logits.double(), dim=-1).float()
    scores = probs if moe.gate.expert_bias is None else probs + moe.gate.expert_bias
    chosen = torch.topk(scores, moe.gate.top_k, dim=-1).indices
    weights = probs.gather(1, chosen)
    if moe.gate.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts = moe.experts
    rows = []
    for token in range(tokens.shape[0]):
        x = tokens[token]
        row = torch.zeros_like(x)
        for choice in range(moe.gate.top_k):
            e = int(chosen[token, choice])
            gate, up = (x @ experts.gate_up_proj[e]).split(experts.intermediate_size)  # gate columns first
            activated = F.silu(gate) * up
            row = row + weights[token, choice] * (activated @ experts.down_proj[e])
        if moe.shared_experts is not None:
            shared = moe.shared_experts
            row = row + shared.down_proj.weight @ (
                F.silu(shared.gate_proj.weight @ x) * (shared.up_proj.weight @ x)
            )
        rows.append(row)
    num_experts = probs.shape[1]
    chosen_fraction = torch.stack([(chosen == e).any(dim=1).float().mean() for e in range(num_experts)])
    aux = num_experts * (chosen_fraction * probs.mean(dim=0)).sum()
    z = (torch.log(torch.exp(logits).sum(dim=-1)) ** 2).mean()
    return torch.stack(rows).reshape(hidden.shape), moe.aux_loss_coef * aux + moe.z_loss_coef * z


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.shape}-E{case.experts}-k{case.top_k}")
def test_block_equals_dense_reference(case: Case) -> None:
    moe = _block(case)
    hidden = torch.randn(case.shape, generator=torch.Generator().manual_seed(9), requires_grad=True)
    grad_out = torch.randn(case.shape, generator=torch.Generator().manual_seed(10))
    out = moe(hidden)
    idle = moe.gate(hidden).tokens_per_expert == 0
    assert bool(idle.any()) == case.expect_idle_expert
    expected, router_loss = dense_reference(moe, hidden)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if case.aux or case.z:
        assert moe.last_router_loss is not None
        torch.testing.assert_close(moe.last_router_loss, router_loss.detach(), atol=1e-6, rtol=1e-5)

    inputs = [hidden, *moe.parameters()]
    names = ["input", *(name for name, _ in moe.named_parameters())]
    grads = torch.autograd.grad((out * grad_out).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * grad_out).sum() + router_loss, inputs)
    for name, grad, expected_grad in zip(names, grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5, msg=name)
    assert (
        torch.count_nonzero(grads[names.index("experts.gate_up_proj")][idle]) == 0
    )  # idle experts: no gradient


def test_eval_mode_attaches_no_loss_and_counts_no_load() -> None:
    moe = _block(CASES[1]).eval()
    moe(torch.randn(CASES[1].shape))
    assert moe.last_router_loss is None and int(moe.gate.expert_load.sum()) == 0


@pytest.mark.parametrize("normalize", [False, True])
def test_block_matches_transformers_qwen3_moe(normalize: bool) -> None:
    config = Qwen3MoeConfig(
        hidden_size=16,
        moe_intermediate_size=12,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=normalize,
    )
    reference = Qwen3MoeSparseMoeBlock(config)
    moe = MoE(16, 6, 2, 12, normalize_top_k=normalize)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3, generator=generator)
        reference.gate.weight.copy_(moe.gate.weight)
        # transformers: gate_up_proj [E, 2 * ffn, hidden] (gate rows first), down_proj [E, hidden, ffn]
        reference.experts.gate_up_proj.copy_(moe.experts.gate_up_proj.transpose(1, 2))
        reference.experts.down_proj.copy_(moe.experts.down_proj.transpose(1, 2))
    hidden = torch.randn(2, 9, 16, generator=generator)
    torch.testing.assert_close(moe(hidden), reference(hidden), atol=1e-5, rtol=1e-5)


def test_the_experts_weigh_their_rows_so_combine_keeps_no_activation_for_backward() -> None:
    """The routing weights are applied to each row's narrow activation inside the experts, so the combine is an
    unweighted sum whose backward needs nothing of the experts' ``[T * k, hidden]`` output (weighing that output
    kept it, or a copy, for the weights' gradient). What the combine saves is only the permutation's indices."""
    moe = _block(CASES[0])
    hidden = torch.randn(CASES[0].shape, requires_grad=True)
    saved: list[torch.Tensor] = []
    combine = moe.dispatcher.combine

    def recording_combine(expert_output: torch.Tensor, dispatched: object) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            return combine(expert_output, dispatched)  # type: ignore[arg-type]

    moe.dispatcher.combine = recording_combine  # type: ignore[method-assign]
    moe(hidden).sum().backward()
    assert saved and not [tuple(t.shape) for t in saved if t.is_floating_point()], [
        (tuple(t.shape), t.dtype) for t in saved
    ]
