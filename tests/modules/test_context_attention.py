"""Context parallelism's load-balanced split and its all-gather attention against full causal attention.

The split is checked against positions written out by hand; the attention on 2 and 3 forked gloo ranks (fp32)
against ``scaled_dot_product_attention(is_causal=True)`` on the whole sequence, forward and the gradients of
q, k and v, with odd chunk lengths and grouped-query heads; and with packed rows (documents crossing the chunks'
edges) against SDPA under the whole document mask, the rank's mask built from gathered positions; each also
within a sliding window (``transformers``' convention: ``i - window < j <= i``), and causal with an attention
logit soft cap against the capped scores computed on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed

from lightning_d9d.modules.context_attention import (
    AllGatherAttention,
    LoadBalancedSplit,
    TorchRingAttention,
    gather_positions,
    masked_attention,
)
from lightning_d9d.modules.documents import document_causal_mask, document_ids

TOLERANCE = 1e-5
# a sliding window shorter than every sequence below and longer than their chunks: it reaches other ranks' keys
WINDOW, SOFT_CAP = 5, 1.0


def test_each_rank_holds_a_head_chunk_and_its_mirror_tail_chunk() -> None:
    # 12 positions in 2*cp = 4 chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert LoadBalancedSplit(2, 0).positions(12).tolist() == [0, 1, 2, 9, 10, 11]
    assert LoadBalancedSplit(2, 1).positions(12).tolist() == [3, 4, 5, 6, 7, 8]
    # cp=3: 6 chunks of 2
    assert LoadBalancedSplit(3, 1).positions(12).tolist() == [2, 3, 8, 9]
    split = LoadBalancedSplit(3, 2)
    assert split.local_positions(4).tolist() == [4, 5, 6, 7]
    sequence = torch.arange(24).view(2, 12)
    assert split.split(sequence).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]


def test_gather_order_restores_the_sequence() -> None:
    split = LoadBalancedSplit(3, 0)
    held = torch.cat([split.positions(18, rank=r) for r in range(3)])
    assert held[split.gather_order(18)].tolist() == list(range(18))


def test_a_sequence_length_not_divisible_by_twice_cp_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"divisible by 2\*cp: 10 % \(2\*3\) = 4"):
        LoadBalancedSplit(3, 0).check(10)


def _attention_parity(seq_len: int, q_heads: int, kv_heads: int) -> dict[str, float]:
    """On each rank: its part of all-gather attention vs the same positions of full causal attention, and with
    a packed batch's document mask (from the gathered positions, as the model builds it) vs full attention
    under the whole mask."""
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    batch, head_dim = 2, 8
    q = torch.randn(batch, q_heads, seq_len, head_dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=generator, requires_grad=True)
    grad_out = torch.randn(batch, q_heads, seq_len, head_dim, generator=generator)
    # documents of 1 to 7 tokens, crossing the chunks' edges; row 1 starts inside a document (positions from 3)
    positions = torch.stack(
        [
            torch.cat([torch.arange(n) for n in _lengths(seq_len, generator)]),
            torch.cat([torch.arange(3, 3 + 5), *(torch.arange(n) for n in _lengths(seq_len - 5, generator))]),
        ]
    )
    whole_mask = document_causal_mask(document_ids(positions))
    split = LoadBalancedSplit(world, rank)
    gathered = gather_positions(split.split(positions), split, dist.group.WORLD)
    assert torch.equal(gathered, positions)
    local_mask = document_causal_mask(document_ids(gathered), split.positions(seq_len))
    index = torch.arange(seq_len)
    causal = index[:, None] >= index[None, :]
    band = index[:, None] - index[None, :] < WINDOW  # transformers' sliding_window_overlay
    differences = {}
    cases = (  # (name, the whole sequence's mask, this rank's document mask, window, soft cap)
        ("causal", causal, None, None, None),
        ("packed", whole_mask, local_mask, None, None),
        ("window", causal & band, None, WINDOW, None),
        ("packed_window", whole_mask & band, local_mask, WINDOW, None),
        ("softcap", causal, None, None, SOFT_CAP),
    )
    for case, mask, documents, window, softcap in cases:
        whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if softcap is None:
            full = F.scaled_dot_product_attention(*whole, attn_mask=mask, enable_gqa=q_heads != kv_heads)
        else:  # transformers' eager attention with a soft cap: repeated kv heads, capped scores, fp32 softmax
            groups = q_heads // kv_heads
            keys, values = (t.repeat_interleave(groups, dim=1) for t in whole[1:])
            scores = whole[0] @ keys.transpose(2, 3) / whole[0].shape[-1] ** 0.5
            scores = torch.tanh(scores / softcap) * softcap + torch.zeros(mask.shape).masked_fill(
                ~mask, -1e30
            )
            full = torch.softmax(scores, dim=-1) @ values
        full.backward(grad_out)
        local = [split.split(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
        out = AllGatherAttention(split, dist.group.WORLD)(*local, documents, window=window, softcap=softcap)
        out.backward(split.split(grad_out, dim=2))
        differences[f"{case}_out"] = (out - split.split(full.detach(), dim=2)).abs().max().item()
        for name, mine, tensor in zip("qkv", local, whole, strict=True):
            assert mine.grad is not None and tensor.grad is not None
            differences[f"{case}_grad_{name}"] = (
                (mine.grad - split.split(tensor.grad, dim=2)).abs().max().item()
            )
    return differences


def _lengths(total: int, generator: torch.Generator) -> list[int]:
    """Random document lengths of 1 to 7 tokens summing to ``total``."""
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, 8, (1,), generator=generator)), total - sum(lengths)))
    return lengths


@pytest.mark.parametrize(
    ("world", "seq_len", "q_heads", "kv_heads"),
    [
        (2, 12, 4, 2),  # chunks of 3 (odd), 2 query heads per kv head
        (2, 8, 2, 2),  # plain multi-head attention
        (3, 18, 6, 2),  # 3 ranks, chunks of 3, 3 query heads per kv head
    ],
)
def test_all_gather_attention_equals_full_causal_attention(
    world: int, seq_len: int, q_heads: int, kv_heads: int
) -> None:
    for rank, differences in enumerate(run_distributed(_attention_parity, world, seq_len, q_heads, kv_heads)):
        for name, difference in differences.items():
            assert difference <= TOLERANCE, f"rank {rank}: {name} differs by {difference:.3g}"


def _choices() -> dict[str, object]:
    """What context_attention picks on a 2-rank gloo (CPU) mesh, and the errors of what it refuses."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_d9d.modules.context_attention import context_attention

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    split = LoadBalancedSplit(2, dist.get_rank())
    errors = {}
    for name in ("torch_ring", "ring_of_fire"):
        try:
            context_attention(split, mesh, name)
        except ValueError as error:
            errors[name] = str(error)
    return {
        "auto": type(context_attention(split, mesh, "auto")).__name__,
        "all_gather": type(context_attention(split, mesh, "all_gather")).__name__,
        "errors": errors,
    }


def test_context_attention_picks_all_gather_off_cuda_and_names_what_it_refuses() -> None:
    for chosen in run_distributed(_choices, 2):
        assert chosen["auto"] == chosen["all_gather"] == "AllGatherAttention"
        errors = chosen["errors"]
        assert "needs a CUDA mesh" in errors["torch_ring"] and "'cpu' mesh" in errors["torch_ring"]
        assert "context_attention='ring_of_fire'" in errors["ring_of_fire"]


def test_masked_attention_without_a_soft_cap_is_sdpa() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=generator) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(masked_attention(q, k, v, mask), expected)
    capped = masked_attention(q, k, v, mask, softcap=1e6)  # a cap far above the logits bends nothing
    torch.testing.assert_close(capped, expected, rtol=1e-5, atol=1e-5)


def test_torch_ring_attention_hands_windowed_layers_to_its_fallback_or_refuses_them() -> None:
    ring = TorchRingAttention.__new__(TorchRingAttention)  # a bare instance, as below
    ring.split = LoadBalancedSplit(2, 0)
    calls = []

    def fallback(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None, *, window: int
    ) -> torch.Tensor:
        calls.append((mask, window))
        return q

    ring.packed = fallback  # type: ignore[assignment]
    q = torch.zeros(1, 2, 4, 8)  # 4 local queries of 8 tokens on cp=2
    assert ring(q, q, q, window=7) is q and calls == [(None, 7)]
    ring.packed = None
    with pytest.raises(
        ValueError,
        match=r"^a sliding window of 7 on 8 tokens under context_attention='torch_ring': torch's ring kernels "
        r"take no window mask; use context_attention='auto'",
    ):
        ring(q, q, q, window=7)


def test_torch_ring_attention_hands_packed_batches_to_its_fallback_or_refuses_them() -> None:
    # torch's ring path cannot be built off CUDA (its constructor refuses a CPU mesh and switches torch's SDPA
    # dispatcher on): its dispatch of a packed batch is checked on a bare instance; tests/gpu builds a real one
    ring = TorchRingAttention.__new__(TorchRingAttention)
    ring.split = LoadBalancedSplit(2, 0)
    calls = []
    ring.packed = lambda q, k, v, mask: calls.append(mask) or q  # type: ignore[assignment,func-returns-value]
    q, mask = torch.zeros(1, 2, 4, 8), torch.ones(1, 1, 4, 8, dtype=torch.bool)
    assert ring(q, q, q, mask) is q and calls == [mask]
    ring.packed = None  # "torch_ring" by name: no fallback
    with pytest.raises(
        ValueError, match=r"under context_attention='torch_ring'.*use context_attention='auto'"
    ):
        ring(q, q, q, mask)


def test_the_strategy_refuses_an_unknown_context_attention_when_built() -> None:
    from lightning_d9d import D9DStrategy

    with pytest.raises(ValueError, match="context_attention='flash'; choose one of 'auto', 'all_gather'"):
        D9DStrategy(cp=2, context_attention="flash")
