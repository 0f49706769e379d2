"""Head-parallel (Ulysses) context parallelism on our models: the exchanges themselves (each rank's heads of the
whole sequence, and back), and cp=2 ``context_attention="heads"`` training Qwen3 (grouped key/value heads, one
key/value head repeated, packed rows, recompute) and Qwen3-MoE against one process: losses and parameters after
3 AdamW steps within 1e-5 (fp32, gloo). Every case runs in one 2-rank launch; what is refused, and why, without
one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d import D9DStrategy
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention, kv_repeats
from lightning_d9d.modules.hybrid_attention import (
    GroupedSplit,
    HeadGroupLayout,
    HybridHeadParallelAttention,
    head_group_size,
)
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, split_batch

ROWS, SEQ, STEPS, TOLERANCE = 2, 16, 3, 1e-5
# packed rows: documents of these lengths fill each row of SEQ, some crossing the cp ranks' chunks
DOCUMENTS = [(5, 11), (3, 6, 7)]
# name -> (model, overrides of its tiny config, packed rows, recompute)
CASES: dict[str, tuple[str, dict[str, Any], bool, bool | str]] = {
    "qwen3": ("qwen3", {}, False, False),  # 4 query heads, 2 key/value heads: 2 and 1 a rank
    "qwen3_one_kv_head": ("qwen3", {"num_key_value_heads": 1}, False, False),  # the kv head repeated
    "qwen3_packed": ("qwen3", {}, True, "selective"),  # the whole rows' document mask; recompute
    "qwen3_moe": ("moe", {}, False, True),
}


# cp=4 with query heads it does not divide: heads split over gcd(heads, 4) = 2 ranks, keys gathered over 2
HYBRID_CASES: dict[str, tuple[str, dict[str, Any], bool, bool | str]] = {
    "qwen3_two_heads": ("qwen3", {"num_attention_heads": 2, "num_key_value_heads": 1}, False, False),
    "qwen3_six_heads_packed": (
        "qwen3",
        {"num_attention_heads": 6, "num_key_value_heads": 2},
        True,
        "selective",
    ),
    "qwen3_moe_two_heads": ("moe", {"num_attention_heads": 2, "num_key_value_heads": 2}, False, False),
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def build(kind: str, overrides: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)  # the model initialises itself from the initial seed: the same weights on every call
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config.tiny(**overrides))
    # no router loss: the loss is the logits' alone, as one process computes it
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(output_router_logits=False, **overrides))


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    labels[0, -5:] = -100  # the rank holding the tail chunks counts fewer tokens
    return ids, labels


def train(model: nn.Module, *, packed: bool, split: LoadBalancedSplit | None = None) -> list[float]:
    """AdamW on fixed batches; under cp (``split``) each rank feeds its chunks and weighs its loss by its share
    of the counted tokens, so that FSDP's mean over the cp ranks is the token mean. The global loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)
    vocab = model.get_submodule("lm_head").weight.shape[0]
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step, vocab)
        inputs: tuple[torch.Tensor, ...] = (ids, packed_positions()) if packed else (ids,)
        if split is not None:
            inputs, labels = split_batch(split, inputs, labels)  # type: ignore[assignment]
        loss = causal_lm_loss(model(*inputs), labels)
        if split is not None:
            count = causal_lm_loss.count(labels).to(torch.int64)
            total = count.clone()
            dist.all_reduce(total)
            loss = loss * (count * split.cp / total)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if split is not None:
            dist.all_reduce(value)
            value /= split.cp
        losses.append(float(value))
    return losses


def _exchanges(split: LoadBalancedSplit, group: dist.ProcessGroup) -> dict[str, float]:
    """Each rank's ``to_heads`` is its heads of the whole sequence, in sequence order (a key/value head repeated
    where cp does not divide them), and ``to_sequence`` of it gives back the rank's own part."""
    attend = HeadParallelAttention(split, group)
    generator = torch.Generator().manual_seed(7)
    errors = {}
    for kv_heads in (2, 1):
        q = torch.randn(2, 4, SEQ, 8, generator=generator)
        k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=generator) for _ in range(2))
        q_heads, k_heads, v_heads = attend.to_heads(*(split.split(x, dim=2) for x in (q, k, v)))
        mine = attend.rank_heads(4)
        repeated = kv_repeats(4, kv_heads, split.cp)
        kv_mine = slice(split.rank * kv_heads * repeated // 2, (split.rank + 1) * kv_heads * repeated // 2)
        expected_k = k.repeat_interleave(repeated, dim=1)[:, kv_mine]
        expected_v = v.repeat_interleave(repeated, dim=1)[:, kv_mine]
        back = attend.to_sequence(q_heads)
        errors[f"q, {kv_heads} kv heads"] = float((q_heads - q[:, mine]).abs().max())
        errors[f"k, {kv_heads} kv heads"] = float((k_heads - expected_k).abs().max())
        errors[f"v, {kv_heads} kv heads"] = float((v_heads - expected_v).abs().max())
        errors[f"back, {kv_heads} kv heads"] = float((back - split.split(q, dim=2)).abs().max())
    return errors


def _train_cases(
    cp: int, cases: dict[str, tuple[str, dict[str, Any], bool, bool | str]], path: type
) -> tuple[dict[str, Any], ParallelDims, LoadBalancedSplit]:
    """Each case trained under cp with ``context_attention="heads"``, its attention checked to be ``path``:
    losses and parameters by case name (and the mesh and split, for more)."""
    dims = ParallelDims(cp=cp).resolve(dist.get_world_size()).build_mesh("cpu")
    split = LoadBalancedSplit(cp, dims.mesh_for("cp").get_local_rank())
    results: dict[str, Any] = {}
    for name, (kind, overrides, packed, recompute) in cases.items():
        model = build(kind, overrides)
        model.parallelize(
            dims, ParallelOptions(context_attention="heads", activation_checkpointing=recompute)
        )
        attention = model.get_submodule("model.layers.0.self_attn")
        inner = getattr(attention, "_checkpoint_wrapped_module", attention)
        assert isinstance(inner.context, path), inner.context
        losses = train(model, packed=packed, split=split)
        params = {
            n.replace("._checkpoint_wrapped_module", ""): full(p).detach().clone()
            for n, p in model.named_parameters()
        }
        results[name] = {"losses": losses, "params": params}
    return results, dims, split


def _head_parallel_runs() -> dict[str, Any]:
    results, dims, split = _train_cases(2, CASES, HeadParallelAttention)
    return {**results, "exchanges": _exchanges(split, dims.mesh_for("cp").get_group())}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_head_parallel_runs, 2)


def _hybrid_runs() -> dict[str, Any]:
    results, dims, _ = _train_cases(4, HYBRID_CASES, HybridHeadParallelAttention)
    # 3 query heads share no divisor with cp=4: no two ranks can split them, the all-gather path runs
    model = build("qwen3", {"num_attention_heads": 3, "num_key_value_heads": 1})
    model.parallelize(dims, ParallelOptions(context_attention="heads"))
    results["three_heads_path"] = type(model.get_submodule("model.layers.0.self_attn").context).__name__
    return results


@pytest.fixture(scope="module")
def hybrid_runs() -> list[dict[str, Any]]:
    return run_distributed(_hybrid_runs, 4)


def test_the_exchanges_give_each_rank_its_heads_of_the_whole_sequence(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert max(rank["exchanges"].values()) == 0.0, rank["exchanges"]


def _trains_like_one_process(
    spec: tuple[str, dict[str, Any], bool, bool | str], case: str, ranks: list[Any]
) -> None:
    kind, overrides, packed, _ = spec
    reference = build(kind, overrides)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected = train(reference, packed=packed)
    got = ranks[0][case]
    assert max(abs(a - b) for a, b in zip(got["losses"], expected, strict=True)) <= TOLERANCE
    assert all(rank[case]["losses"] == got["losses"] for rank in ranks)
    assert set(got["params"]) == set(start)
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in reference.named_parameters())
    assert moved > 1e-3  # the steps changed the parameters
    for n, p in reference.named_parameters():
        assert float((got["params"][n] - p.detach()).abs().max()) <= TOLERANCE, n


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_heads_trains_like_one_process(case: str, runs: list[dict[str, Any]]) -> None:
    _trains_like_one_process(CASES[case], case, runs)


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_cp4_heads_cp_does_not_divide_trains_like_one_process(
    case: str, hybrid_runs: list[dict[str, Any]]
) -> None:
    _trains_like_one_process(HYBRID_CASES[case], case, hybrid_runs)


def test_a_head_group_holds_its_members_positions_in_order() -> None:
    """cp=8 in head groups of 2 (4 key groups): group 1 holds base ranks 2 and 3's chunks, ascending; the members'
    parts, member after member, are the group's positions taken in held order, and gather order undoes it."""
    seq = 32  # 16 chunks of 2
    group = GroupedSplit(4, 1, group_size=2)
    assert group.positions(seq).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    base = LoadBalancedSplit(8, 0)
    layout = HeadGroupLayout(group, member=1)
    ascending = group.positions(seq)
    parts = torch.cat([base.positions(seq, rank=2), base.positions(seq, rank=3)])
    assert torch.equal(ascending[layout.held_order(seq // 4)], parts)
    assert torch.equal(parts[layout.gather_order(seq // 4)], ascending)
    every = torch.cat([group.positions(seq, rank=g) for g in range(4)])
    assert sorted(every.tolist()) == list(range(seq))  # the key groups' positions tile the sequence


def test_kv_repeats_make_cp_divide_the_kv_heads() -> None:
    assert kv_repeats(4, 2, 2) == 1
    assert kv_repeats(4, 1, 2) == 2
    assert kv_repeats(16, 2, 8) == 4 and (16 // 2) % 4 == 0  # a divisor of each kv head's query group
    assert kv_repeats(24, 3, 8) == 8 and (24 // 3) % 8 == 0


def test_query_heads_no_two_cp_ranks_can_split_take_the_all_gather_path(
    hybrid_runs: list[dict[str, Any]],
) -> None:
    assert head_group_size(8, 4) == 4 and head_group_size(6, 4) == 2 and head_group_size(3, 4) == 1
    assert all(rank["three_heads_path"] == "AllGatherAttention" for rank in hybrid_runs)


def test_the_strategy_takes_heads_and_refuses_other_names_when_built() -> None:
    D9DStrategy(cp=2, context_attention="heads")
    with pytest.raises(ValueError, match=r"context_attention='ulysses'; choose one of .*'heads'"):
        D9DStrategy(cp=2, context_attention="ulysses")
