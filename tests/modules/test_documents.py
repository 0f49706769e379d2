"""The boundary format of packed rows: document numbers from restarting positions, the block-diagonal causal
mask (whole, or a context-parallel rank's queries), the attended keys per query and each cp rank's share of them
(against the mask summed by brute force), and the refusals of positions or lengths that are not that format."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.modules.context_attention import LoadBalancedSplit, context_attention_work
from lightning_d9d.modules.documents import (
    attended_keys,
    check_position_ids,
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
