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


def test_a_document_with_a_prompt_stays_whole_by_default() -> None:
    prompted = [
        Document([1, 2, 3, 4, 5, 6], prompt_length=3),
        Document([11, 12, 13, 14, 15, 16], prompt_length=2),
    ]
    rows = list(pack_documents(prompted, 8))
    # the second document does not fit the 3 places left in row 0: it starts row 1 with its prompt
    assert [row["input_ids"].tolist() for row in rows] == [
        [1, 2, 3, 4, 5, 0, 0, 0],
        [11, 12, 13, 14, 15, 0, 0, 0],
    ]
    assert [row["labels"].tolist() for row in rows] == [
        [-100, -100, 4, 5, 6, -100, -100, -100],
        [-100, 13, 14, 15, 16, -100, -100, -100],
    ]
    assert all(row["position_ids"][0] == 0 for row in rows)  # no row starts inside a document
    # pretraining documents beside them still continue into the next row
    mixed = list(pack_documents([prompted[0], [20, 21, 22, 23, 24], prompted[1]], 8))
    assert [row["input_ids"].tolist() for row in mixed] == [
        [1, 2, 3, 4, 5, 20, 21, 22],
        [23, 11, 12, 13, 14, 15, 0, 0],
    ]
    # asked for, a prompted document continues too
    cut = list(pack_documents(prompted, 8, whole_documents=False))
    assert [row["input_ids"].tolist() for row in cut] == [
        [1, 2, 3, 4, 5, 11, 12, 13],
        [14, 15, 0, 0, 0, 0, 0, 0],
    ]


def test_a_longer_than_row_document_with_a_prompt_is_refused_by_default_naming_it_and_the_fix() -> None:
    documents = [[50, 51], Document(list(range(1, 12)), prompt_length=4)]
    with pytest.raises(
        ValueError,
        match=r"document 1 has 11 tokens, 10 training positions: more than a row of seq_len=4: it has a loss mask.*"
        r"Raise seq_len.*long_documents='split'",
    ):
        PackedDataset(documents, 4)
    # asked for: row-long pieces, from the start of a row
    rows = list(pack_documents(documents, 4, long_documents="split"))
    assert [row["position_ids"].tolist() for row in rows] == [
        [0, 0, 1, 2],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [0, 1, 0, 1],
    ]
    with pytest.raises(ValueError, match=r"whole_documents='yes': choose True, False or None"):
        list(pack_documents(documents, 4, whole_documents="yes"))  # type: ignore[arg-type]


def test_a_loss_mask_learns_the_tokens_it_marks_each_predicted_from_the_token_before() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    learnt = [0, 0, 1, 1, 0, 0, 1, 1]  # two answers: tokens 3, 4 and 7, 8
    (row,) = pack_documents([Document(tokens, loss_mask=learnt)], 8)
    # label j is token j + 1: a label is trained where the token it predicts is learnt
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert row["labels"].tolist() == [-100, 3, 4, -100, -100, 7, 8, -100]
    # with a prompt_length too, a token is learnt when it is past the prompt and inside the mask
    (both,) = pack_documents([Document(tokens, prompt_length=4, loss_mask=torch.tensor(learnt).bool())], 8)
    assert both["labels"].tolist() == [-100, -100, -100, -100, -100, 7, 8, -100]


def test_a_document_with_a_loss_mask_stays_whole_and_a_wrong_mask_is_refused_naming_it() -> None:
    masked = Document(
        [11, 12, 13, 14], loss_mask=[True] * 4
    )  # a mask that learns everything still keeps it whole
    rows = list(pack_documents([[1, 2, 3], masked], 4))
    assert [row["input_ids"].tolist() for row in rows] == [[1, 2, 0, 0], [11, 12, 13, 0]]
    with pytest.raises(
        ValueError, match=r"document 1: loss_mask has 3 values for 4 tokens: give one per token"
    ):
        list(pack_documents([[1, 2, 3], Document([11, 12, 13, 14], loss_mask=[1, 1, 1])], 4))
    with pytest.raises(
        ValueError, match=r"document 0: loss_mask must hold booleans or integers 0/1.*such as \[2\]"
    ):
        list(pack_documents([Document([11, 12, 13], loss_mask=[0, 2, 1])], 4))
    with pytest.raises(
        ValueError, match=r"document 0: loss_mask must hold booleans or integers 0/1.*got torch.float"
    ):
        list(pack_documents([Document([11, 12, 13], loss_mask=torch.ones(3))], 4))
