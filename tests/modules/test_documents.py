"""The boundary format of packed rows: document numbers from restarting positions, the block-diagonal causal
mask, and the refusals of positions or lengths that are not that format."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.modules.documents import (
    check_position_ids,
    document_causal_mask,
    document_ids,
    position_ids_from_lengths,
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
