"""``chat_documents``: only the assistant's turns are learnt, token by token as the chat template marks them, in
multi-turn conversations, on packed rows; a template without ``{% generation %}`` markers gives the same mask from
its renderings of the conversation's prefixes; and the refusals. The tokenizer is built locally (word level, no
Hub: chat_tokenizer.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from chat_tokenizer import MARKED, UNMARKED, word_tokenizer
from transformers import PreTrainedTokenizerFast

import lightning_d9d.data
from lightning_d9d.data import PackedDataset, chat_documents

CONVERSATIONS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and three plus three"},
        {"role": "assistant", "content": "six of course"},
    ],
    [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello there"}],
    [
        {"role": "user", "content": "count to three"},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "thanks"},
    ],
]
ASSISTANT = [
    message for conversation in CONVERSATIONS for message in conversation if message["role"] == "assistant"
]


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    """Word level over these conversations' words (:func:`chat_tokenizer.word_tokenizer`)."""
    return word_tokenizer(template, CONVERSATIONS)


def test_only_the_assistants_turns_are_learnt_token_by_token_as_the_template_marks_them() -> None:
    marked = tokenizer(MARKED)
    documents = list(chat_documents(CONVERSATIONS, marked))
    for conversation, document in zip(CONVERSATIONS, documents, strict=True):
        theirs = marked.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(document.tokens) == theirs["input_ids"]
        assert [bool(learnt) for learnt in document.loss_mask] == [bool(m) for m in theirs["assistant_masks"]]
    # what is learnt, written out: every assistant reply, each with its end of turn, in order (multi-turn)
    learnt = [t for d in documents for t, on in zip(d.tokens, d.loss_mask, strict=True) if on]
    im_end, newline = marked.convert_tokens_to_ids(["<|im_end|>", "\n"])
    expected = [
        t for m in ASSISTANT for t in [*marked.convert_tokens_to_ids(m["content"].split()), im_end, newline]
    ]
    assert learnt == expected
    assert marked.unk_token_id not in learnt


def test_a_template_without_markers_gives_the_same_mask_from_its_prefixes() -> None:
    marked = list(chat_documents(CONVERSATIONS, tokenizer(MARKED)))
    unmarked = list(chat_documents(CONVERSATIONS, tokenizer(UNMARKED)))
    for by_markers, by_prefixes in zip(marked, unmarked, strict=True):
        assert list(by_prefixes.tokens) == list(by_markers.tokens)
        assert list(by_prefixes.loss_mask) == list(by_markers.loss_mask)


def test_packed_rows_train_only_the_next_tokens_that_are_the_assistants() -> None:
    documents = list(chat_documents(CONVERSATIONS, tokenizer(UNMARKED)))
    lengths = [len(document.tokens) for document in documents]
    seq_len = max(lengths)  # the longest fills a row; the others do not fit beside it
    rows = PackedDataset(documents, seq_len)
    starts = [
        (row, int(at)) for row in range(len(rows)) for at in torch.nonzero(rows[row]["position_ids"] == 0)
    ]
    for number, (document, length) in enumerate(zip(documents, lengths, strict=True)):
        found = [  # each conversation lies whole in one row: find it by its tokens
            (row, at)
            for row, at in starts
            if rows[row]["input_ids"][at : at + length - 1].tolist() == list(document.tokens[:-1])
        ]
        assert len(found) == 1, f"conversation {number} is not whole in one row"
        ((row, at),) = found
        assert rows[row]["position_ids"][at : at + length - 1].tolist() == list(range(length - 1))
        labels = rows[row]["labels"][at : at + length - 1].tolist()
        for position, label in enumerate(labels):  # label t predicts token t + 1
            target, learnt = document.tokens[position + 1], document.loss_mask[position + 1]
            assert label == (target if learnt else -100), (position, label)
    trained = sum(int((rows[row]["labels"] != -100).sum()) for row in range(len(rows)))
    assert trained == sum(sum(document.loss_mask) for document in documents)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_turn_and_the_fix() -> None:
    # earlier assistant turns rendered shorter once a later turn follows (as templates that drop old reasoning do)
    rewriting = UNMARKED.replace(
        "{%- if message['role'] == 'assistant' %}",
        "{%- if message['role'] == 'assistant' and not loop.last %}{{- '<|im_end|>\n' }}"
        "{%- elif message['role'] == 'assistant' %}",
    )
    with pytest.raises(
        ValueError,
        match=r"conversation 0, message 2: the chat template renders the conversation up to this assistant turn "
        r"differently.*\{% generation %\}",
    ):
        list(chat_documents(CONVERSATIONS[:1], tokenizer(rewriting)))


@pytest.mark.parametrize(
    ("conversation", "error"),
    [
        (
            [{"role": "user", "content": "say hello"}],
            r"conversation 0 has no assistant message \(roles \['user'\]\)",
        ),
        ([{"content": "say hello"}], r"conversation 0, message 0: a message is a mapping with a 'role'"),
        ({"messages": CONVERSATIONS[1]}, r"conversation 0 must be a list of messages.*got dict"),
        ([{"role": "assistant", "content": "hello"}], r"conversation 0 starts with an assistant message"),
    ],
)
def test_bad_conversations_are_refused_naming_them(conversation: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        list(chat_documents([conversation], tokenizer(UNMARKED)))


def test_a_template_whose_markers_enclose_no_assistant_turn_and_a_wrong_tokenizer_are_refused() -> None:
    elsewhere = UNMARKED + "{%- generation %}{%- endgeneration %}"  # markers, but around nothing
    with pytest.raises(ValueError, match=r"conversation 0: the chat template marks none of its tokens"):
        list(chat_documents(CONVERSATIONS, tokenizer(elsewhere)))
    with pytest.raises(TypeError, match=r"tokenizer must be a transformers tokenizer, got str"):
        chat_documents(CONVERSATIONS, "Qwen/Qwen3-0.6B")
    slow = SimpleNamespace(apply_chat_template=print, is_fast=False)
    with pytest.raises(ValueError, match=r"not a fast tokenizer.*use_fast=True"):
        chat_documents(CONVERSATIONS, slow)


def test_the_data_package_imports_no_transformers() -> None:
    sources = Path(lightning_d9d.data.__file__).parent.glob("*.py")
    imported = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for path in sources
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert "lightning_d9d" in imported and "transformers" not in imported
