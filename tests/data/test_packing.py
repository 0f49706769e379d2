"""``pack_documents``: rows of exactly ``seq_len`` tokens, labels that are each document's own next tokens,
positions that restart per document, prompts out of the loss, and the refusals."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.data import Document, PackedDataset, pack_documents
from lightning_d9d.modules.documents import check_position_ids, document_ids


def _docs() -> list[list[int]]:
    return [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41]]


def test_rows_are_full_and_labels_are_each_documents_next_tokens() -> None:
    rows = list(pack_documents(_docs(), 5, pad_id=0))
    assert all(row[key].shape == (5,) for row in rows for key in ("input_ids", "labels", "position_ids"))
    # 3 + 2 + 5 + 1 = 11 training positions: rows of 5, 5 and 1 (+ 4 of padding)
    assert [row["input_ids"].tolist() for row in rows] == [
        [10, 11, 12, 20, 21],
        [30, 31, 32, 33, 34],
        [40, 0, 0, 0, 0],
    ]
    assert [row["labels"].tolist() for row in rows] == [
        [11, 12, 13, 21, 22],
        [31, 32, 33, 34, 35],
        [41, -100, -100, -100, -100],
    ]
    assert [row["position_ids"].tolist() for row in rows] == [
        [0, 1, 2, 0, 1],
        [0, 1, 2, 3, 4],
        [0, 0, 1, 2, 3],  # the padding is a document of its own
    ]
    for row in rows:
        check_position_ids(row["position_ids"][None])


def test_a_document_that_does_not_fit_continues_as_a_new_document_or_starts_the_next_row() -> None:
    split = list(pack_documents([[1, 2, 3, 4], [5, 6, 7, 8]], 4))
    assert [row["input_ids"].tolist() for row in split] == [[1, 2, 3, 5], [6, 7, 0, 0]]
    assert [row["position_ids"].tolist() for row in split] == [[0, 1, 2, 0], [0, 1, 0, 1]]
    whole = list(pack_documents([[1, 2, 3, 4], [5, 6, 7, 8]], 4, whole_documents=True))
    assert [row["input_ids"].tolist() for row in whole] == [[1, 2, 3, 0], [5, 6, 7, 0]]
    assert [row["labels"].tolist() for row in whole] == [[2, 3, 4, -100], [6, 7, 8, -100]]


def test_a_longer_than_row_document_is_cut_into_pieces_or_refused_naming_it() -> None:
    long = list(range(1, 12))  # 11 tokens, 10 training positions
    rows = list(pack_documents([[50, 51], long], 4))
    assert [row["position_ids"].tolist() for row in rows] == [[0, 0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 0]]
    with pytest.raises(ValueError, match=r"document 1 has 11 tokens, 10 training positions.*seq_len=4"):
        list(pack_documents([[50, 51], long], 4, long_documents="refuse"))


def test_prompt_tokens_are_context_only() -> None:
    (row,) = pack_documents([Document([1, 2, 3, 4, 5, 6], prompt_length=3), [7, 8]], 6)
    # labels 2 and 3 are predictions of prompt tokens; 4, 5, 6 (the answer) are trained
    assert row["labels"].tolist() == [-100, -100, 4, 5, 6, 8]
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 7]
    with pytest.raises(ValueError, match=r"document 0: prompt_length=9 must lie in 0..6"):
        list(pack_documents([Document([1, 2, 3, 4, 5, 6], prompt_length=9)], 6))


def test_the_dataset_batches_into_the_models_inputs() -> None:
    data = PackedDataset([torch.arange(1, 9), torch.arange(20, 25)], 4)
    batch = torch.utils.data.default_collate([data[i] for i in range(len(data))])
    assert batch["input_ids"].shape == batch["position_ids"].shape == (3, 4)
    assert document_ids(batch["position_ids"]).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]]
