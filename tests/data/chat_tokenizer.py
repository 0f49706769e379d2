"""A fast ``transformers`` tokenizer built here (word level, no Hub) with a ChatML chat template, for the chat
tests: with ``{% generation %}`` markers around the assistant's turns (:data:`MARKED`) or without
(:data:`UNMARKED`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# ChatML; the markers enclose what the model writes after "<|im_start|>assistant\n": its reply and the end of turn
MARKED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>\n' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
UNMARKED = MARKED.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")


def word_tokenizer(
    template: str, conversations: Iterable[Sequence[Mapping[str, Any]]]
) -> PreTrainedTokenizerFast:
    """Words and newlines are tokens, spaces separate; the vocabulary is ``[UNK]`` (id 0), the newline, then the
    roles and words of ``conversations`` in sorted order; the turn markers are special tokens after them."""
    words = sorted({word for c in conversations for m in c for word in (m["role"], *m["content"].split())})
    vocab = {word: number for number, word in enumerate(["[UNK]", "\n", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    wrapped.chat_template = template
    return wrapped
