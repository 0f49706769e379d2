"""Conversations to loss-masked documents: the tokens of the assistant's turns are learnt, every other token (the
system prompt, the users' turns, the role headers the template writes) is context only.

A conversation is a list of messages ``{"role": ..., "content": ...}``; a ``transformers`` tokenizer renders it
with its chat template. Which tokens are the assistant's comes from the template:

- a template that marks the assistant's turns with ``{% generation %}`` ... ``{% endgeneration %}``: the mask
  ``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)`` returns, exactly what the markers
  enclose;
- a template without markers: each assistant turn's characters are what rendering the conversation up to that
  turn adds to rendering the conversation before it with the generation prompt, that is, everything the model
  writes after the template's assistant header (its reply and the end-of-turn text). The tokens overlapping
  those characters are learnt, as for the markers. This holds only when every rendering of a shorter
  conversation is the start of the whole one; a template that renders an earlier turn differently once later
  turns follow (some drop earlier turns' reasoning) is refused, naming the turn.

Both paths need a fast tokenizer (character offsets). ``transformers`` itself is never imported here: the
tokenizer brings it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from lightning_d9d.data.packing import Document

Conversation = Sequence[Mapping[str, Any]]

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_documents(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[Document]:
    """One :class:`Document` per conversation, its ``loss_mask`` ``True`` on the assistant's tokens (module
    docstring). ``tokenizer`` is a fast ``transformers`` tokenizer; ``chat_template`` (a template or the name of
    one of the tokenizer's) replaces its own; ``template_kwargs`` go to the template (``enable_thinking=False``,
    ...). The packer keeps these documents whole. The tokenizer and its template are checked here, each
    conversation as it is read."""
    template = _template(tokenizer, chat_template)
    return _documents(conversations, tokenizer, template, dict(template_kwargs or {}))


def _documents(
    conversations: Iterable[Conversation], tokenizer: Any, template: str, extra: dict[str, Any]
) -> Iterator[Document]:
    by_markers = _GENERATION_MARKER.search(template) is not None
    for index, conversation in enumerate(conversations):
        _check_conversation(conversation, index)
        messages = [dict(message) for message in conversation]
        if by_markers:
            ids, mask = _masked_by_markers(messages, tokenizer, template, extra)
        else:
            ids, mask = _masked_by_prefixes(messages, tokenizer, template, extra, index)
        if not any(mask):
            raise ValueError(
                f"conversation {index}: the chat template marks none of its tokens as the assistant's. Put "
                "{% generation %} ... {% endgeneration %} around every assistant turn the template writes"
            )
        yield Document(ids, loss_mask=mask)


def _template(tokenizer: Any, chat_template: str | None) -> str:
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer: the assistant's tokens are found from "
            "character offsets, which only fast tokenizers give. Load it with use_fast=True"
        )
    template = tokenizer.get_chat_template(chat_template)
    if not isinstance(template, str):
        raise ValueError(f"the tokenizer's chat template is {type(template).__name__}, not a template string")
    return template


def _check_conversation(conversation: Conversation, index: int) -> None:
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise ValueError(
            f"conversation {index} must be a list of messages {{'role': ..., 'content': ...}}, got "
            f"{type(conversation).__name__} (a dataset row's messages, not the row)"
        )
    roles = []
    for turn, message in enumerate(conversation):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"conversation {index}, message {turn}: a message is a mapping with a 'role' and its 'content', "
                f"got {str(message)[:80]!r}"
            )
        roles.append(message["role"])
    if "assistant" not in roles:
        raise ValueError(
            f"conversation {index} has no assistant message (roles {roles}): nothing in it is learnt. Drop it"
        )


def _masked_by_markers(
    messages: list[dict[str, Any]], tokenizer: Any, template: str, extra: dict[str, Any]
) -> tuple[list[int], list[bool]]:
    encoded = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **extra,
    )
    return list(encoded["input_ids"]), [bool(learnt) for learnt in encoded["assistant_masks"]]


def _masked_by_prefixes(
    messages: list[dict[str, Any]], tokenizer: Any, template: str, extra: dict[str, Any], index: int
) -> tuple[list[int], list[bool]]:
    def render(turns: list[dict[str, Any]], generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            turns, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
        return str(text)

    whole = render(messages, False)
    spans = [_assistant_span(render, messages, turn, whole, index) for turn in _assistant_turns(messages)]
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    # a token is learnt when its characters overlap a turn's (the rule transformers applies to the markers)
    mask = [
        any(first < end and last > start for start, end in spans) for first, last in encoded["offset_mapping"]
    ]
    return list(encoded["input_ids"]), mask


def _assistant_turns(messages: list[dict[str, Any]]) -> list[int]:
    return [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]


def _assistant_span(
    render: Callable[[list[dict[str, Any]], bool], str],
    messages: list[dict[str, Any]],
    turn: int,
    whole: str,
    index: int,
) -> tuple[int, int]:
    """The characters of the whole rendering that assistant turn ``turn`` adds after its generation prompt."""
    if turn == 0:
        raise ValueError(
            f"conversation {index} starts with an assistant message: without {{% generation %}} markers in the "
            "template its tokens are found after a rendered prompt, and there is none"
        )
    prompt, reply = render(messages[:turn], True), render(messages[: turn + 1], False)
    if not (whole.startswith(prompt) and whole.startswith(reply) and len(prompt) < len(reply)):
        raise ValueError(
            f"conversation {index}, message {turn}: the chat template renders the conversation up to this "
            "assistant turn differently from the start of the whole conversation, so its tokens cannot be told "
            "from its prompt. Use a template with {% generation %} ... {% endgeneration %} around the assistant's "
            "turns (chat_template=...)"
        )
    return len(prompt), len(reply)
