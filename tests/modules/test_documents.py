"""The boundary format of packed rows: document numbers from restarting positions, the block-diagonal causal
mask (dense, FlexAttention's block-sparse one, or a context-parallel rank's queries), the attended keys per
query and each cp rank's share of them (against the mask summed by brute force), the refusals of positions or
lengths that are not that format, and the choice of the attention path for packed rows."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from lightning_d9d.modules.attention import (
    document_attention,
    document_attention_mask,
    document_attention_path,
)
from lightning_d9d.modules.context_attention import LoadBalancedSplit, context_attention_work
from lightning_d9d.modules.documents import (
    BLOCK,
    attended_keys,
    check_position_ids,
    document_block_mask,
    document_causal_mask,
    document_ids,
    position_ids_from_lengths,
)

# a row starting inside a document (positions from 5), long and short documents, a one-token document last
ROWS = torch.tensor(
    [
        [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5],
        [5, 6, 0, 1, 2, 3, 4, 0, 1, 0, 1, 0],
        list(range(12)),  # one document: plain causal
    ]
)


def test_documents_are_numbered_where_positions_restart() -> None:
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2], [5, 6, 0, 1, 2, 3, 4, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2], [-1, -1, 0, 0, 0, 0, 0, 1, 2]], dtype=torch.int32)
    assert torch.equal(document_ids(positions), expected)


def test_the_mask_is_causal_inside_each_document_only() -> None:
    mask = document_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_a_context_parallel_ranks_mask_is_its_queries_rows_of_the_whole_mask() -> None:
    documents = document_ids(ROWS)
    whole = document_causal_mask(documents)
    split = LoadBalancedSplit(3, 1)  # queries 2, 3 and 8, 9 of 12
    mine = document_causal_mask(documents, split.positions(12))
    assert mine.shape == (3, 1, 4, 12)
    assert torch.equal(mine, whole[:, :, split.positions(12)])


def test_attended_keys_are_the_rows_of_the_mask_summed() -> None:
    expected = document_causal_mask(document_ids(ROWS)).sum(-1)[:, 0]
    assert torch.equal(attended_keys(ROWS), expected)
    assert attended_keys(ROWS)[1].tolist() == [1, 2, 1, 2, 3, 4, 5, 1, 2, 1, 2, 1]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_each_cp_ranks_attention_work_is_the_mask_summed_over_its_queries(cp: int) -> None:
    mask = document_causal_mask(document_ids(ROWS))[:, 0]  # [B, T, T]
    split = LoadBalancedSplit(cp, 0)
    by_brute_force = [int(mask[:, split.positions(12, rank=r)].sum()) for r in range(cp)]
    assert context_attention_work(ROWS, split).tolist() == by_brute_force
    assert sum(by_brute_force) == int(mask.sum())
    # one document per row: the head-and-tail split gives every rank the same work
    causal = context_attention_work(ROWS[2:], split)
    assert (causal == causal[0]).all(), causal.tolist()


def test_positions_from_lengths_and_their_refusals() -> None:
    assert position_ids_from_lengths([3, 1, 2], 6).tolist() == [0, 1, 2, 0, 0, 1]
    with pytest.raises(ValueError, match=r"lengths \[3, 2\] sum to 5, not to the row's length 6"):
        position_ids_from_lengths([3, 2], 6)
    with pytest.raises(ValueError, match="must be positive"):
        position_ids_from_lengths([3, 0, 3], 6)


def test_positions_that_do_not_count_up_or_restart_are_refused_naming_the_place() -> None:
    check_position_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 0, 0, 1, 2]]))
    with pytest.raises(ValueError, match=r"position_ids\[1, 3\] = 5 after 1"):
        check_position_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 5, 6]]))


def _random_rows(seed: int, rows: int, length: int) -> torch.Tensor:
    """Packed positions: documents of 1 to 300 tokens; the last row starts inside a document (positions not
    from 0), the one before is a single document."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows - 2):
        lengths: list[int] = []
        while sum(lengths) < length:
            lengths.append(min(int(torch.randint(1, 300, (1,), generator=generator)), length - sum(lengths)))
        out.append(position_ids_from_lengths(lengths, length))
    out.append(torch.arange(length))
    out.append(torch.cat([torch.arange(70, 70 + 200), torch.arange(length - 200)]))
    return torch.stack(out)


def test_the_block_mask_skips_exactly_the_empty_tiles_and_masks_only_the_boundary_ones() -> None:
    documents = document_ids(_random_rows(0, 8, 1024))
    block_mask = document_block_mask(documents)
    dense = document_causal_mask(documents)[:, 0]  # [B, T, T]
    tiles = dense.view(8, 8, BLOCK, 8, BLOCK).transpose(2, 3)  # [B, query block, key block, BLOCK, BLOCK]
    some, every = tiles.any((-1, -2)), tiles.all((-1, -2))
    # the tiles the kernel visits are exactly those with an attending pair, and it skips the mask exactly
    # where every pair attends (a wrong 'full' tile would let a token see another document)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), some)
    full = torch.zeros_like(some)
    for b in range(8):
        for i in range(8):
            count = int(block_mask.full_kv_num_blocks[b, 0, i])
            full[b, i, block_mask.full_kv_indices[b, 0, i, :count].long()] = True
    assert torch.equal(full, every & ~torch.eye(8, dtype=torch.bool))  # the diagonal tiles keep the mask
    assert every.sum() > 8  # the rows have tiles inside one document, so 'full' is exercised
    # evaluated per element, the block mask is the dense mask
    b, q, k = (
        t.flatten() for t in torch.meshgrid(*(torch.arange(n) for n in (8, 1024, 1024)), indexing="ij")
    )
    assert torch.equal(block_mask.mask_mod(b, None, q, k).view(8, 1024, 1024), dense)


def test_flex_attention_on_the_block_mask_is_the_dense_masked_attention() -> None:
    documents = document_ids(_random_rows(1, 4, 256))
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(4, 4, 256, 16, generator=generator)
    k, v = (torch.randn(4, 2, 256, 16, generator=generator) for _ in range(2))
    with torch.no_grad():  # torch's FlexAttention has no CPU backward; the gpu test covers gradients
        flex = document_attention(q, k, v, document_block_mask(documents))
    dense = document_attention(q, k, v, document_causal_mask(documents))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


def test_the_document_attention_path_is_chosen_and_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    positions = torch.arange(256)[None]
    assert document_attention_path(positions) == "sdpa"  # auto on CPU: the dense mask
    assert isinstance(document_attention_mask(positions), torch.Tensor)
    with torch.no_grad():
        assert isinstance(document_attention_mask(positions, "flex"), BlockMask)
    with pytest.raises(ValueError, match=r"'flex' cannot train on CPU.*choose 'sdpa'"):
        document_attention_mask(positions, "flex")
    with torch.no_grad(), pytest.raises(ValueError, match=r"multiple of 128, got 200: pad the rows"):
        document_attention_mask(positions[:, :200], "flex")
    monkeypatch.setenv("LIGHTNING_D9D_DOCUMENT_ATTENTION", "varlen")
    with pytest.raises(ValueError, match=r"'varlen' .*choose one of 'auto', 'flex', 'sdpa'"):
        document_attention_mask(positions)
    monkeypatch.delenv("LIGHTNING_D9D_DOCUMENT_ATTENTION")
    with pytest.raises(
        ValueError, match=r"integer \[batch, sequence\] tensor, got torch.float32 of shape \(256,\)"
    ):
        document_attention_mask(torch.arange(256.0))
