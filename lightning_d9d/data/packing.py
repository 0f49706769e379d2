"""Documents packed into fixed-length rows, for a data pipeline: no padding between documents, and attention and
labels that never cross a boundary.

Each document of ``n`` tokens gives ``n - 1`` training positions: inputs ``tokens[:-1]``, labels ``tokens[1:]``
(the next token of the same document), positions ``0 .. n - 2`` (restarting at 0 is the boundary: see
:mod:`lightning_d9d.modules.documents`). Documents fill the rows in order. The last row is padded: pad tokens
with labels ``ignore_index`` (no loss), positions restarting at 0 (a document of their own, attending nothing
else).

For supervised fine-tuning give each document its ``prompt_length`` (the first tokens are a prompt) or its
``loss_mask`` (one boolean per token, ``True`` where the token is learnt: the assistant's turns of a chat, see
:mod:`lightning_d9d.data.chat`): a token outside them is context only, its label (the prediction of it, at the
position before it) is ``ignore_index`` and contributes nothing to the loss or the gradients.

Where a document goes depends on whether it has a loss mask (a ``prompt_length`` or a ``loss_mask``):

- without one (pretraining text), a document that does not fit the rest of a row continues in the next row as a
  new document (positions restart), and one longer than a row is cut into row-long pieces, each its own
  document;
- with one, a document stays whole: one that does not fit the rest of a row starts the next row (the row is
  padded), and one longer than a row is refused, naming it; a piece of it would train an answer without its
  prompt.

``whole_documents`` (``True``: every document whole, ``False``: every document may continue) and
``long_documents`` (``"split"`` or ``"refuse"``, for every document) override these defaults.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.data import Dataset

LongDocuments = Literal["split", "refuse"]
_LONG_DOCUMENTS = ("split", "refuse")
Row = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Document:
    """One document's token ids. Its tokens are learnt (predicted in the loss) except the first
    ``prompt_length`` (a prompt) and, where ``loss_mask`` is given (one boolean or 0/1 per token), those it marks
    ``False``."""

    tokens: Sequence[int] | torch.Tensor
    prompt_length: int = 0
    loss_mask: Sequence[bool] | Sequence[int] | torch.Tensor | None = None

    @property
    def has_loss_mask(self) -> bool:
        """Whether it says which tokens are learnt: the packer keeps such a document whole by default."""
        return self.prompt_length > 0 or self.loss_mask is not None


def _learnt_tokens(document: Document, length: int, index: int) -> torch.Tensor:
    """``[length]`` booleans: which of the document's tokens the loss learns."""
    if not 0 <= document.prompt_length <= length:
        raise ValueError(
            f"document {index}: prompt_length={document.prompt_length} must lie in 0..{length} (its number of "
            "tokens)"
        )
    learnt = torch.ones(length, dtype=torch.bool)
    learnt[: document.prompt_length] = False
    if document.loss_mask is None:
        return learnt
    mask = torch.as_tensor(document.loss_mask).flatten()
    if mask.numel() != length:
        raise ValueError(
            f"document {index}: loss_mask has {mask.numel()} values for {length} tokens: give one per token"
        )
    if not _holds_booleans(mask):
        wrong = mask[mask.ne(0) & mask.ne(1)][:4].tolist()
        raise ValueError(
            f"document {index}: loss_mask must hold booleans or integers 0/1 (True where a token is learnt), got "
            f"{mask.dtype}" + (f" values such as {wrong}" if wrong else "")
        )
    return learnt & mask.bool()


def _holds_booleans(mask: torch.Tensor) -> bool:
    if mask.dtype == torch.bool or mask.numel() == 0:
        return True
    integral = not (mask.is_floating_point() or mask.is_complex())
    return integral and bool((mask.eq(0) | mask.eq(1)).all())


def _segment(document: Document, index: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.as_tensor(document.tokens, dtype=torch.long).flatten()
    learnt = _learnt_tokens(document, tokens.numel(), index)
    inputs, labels = tokens[:-1], tokens[1:].clone()
    # label j is token j + 1: it is trained when token j + 1 is learnt
    labels[~learnt[1:]] = ignore_index
    return inputs, labels


def pack_documents(
    documents: Iterable[Document | Sequence[int] | torch.Tensor],
    seq_len: int,
    *,
    pad_id: int = 0,
    ignore_index: int = -100,
    long_documents: LongDocuments | None = None,
    whole_documents: bool | None = None,
) -> Iterator[Row]:
    """Rows ``{"input_ids", "labels", "position_ids"}`` of ``seq_len`` tokens each (module docstring). ``None``
    for ``long_documents`` or ``whole_documents``: decided per document by whether it has a loss mask."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if long_documents is not None and long_documents not in _LONG_DOCUMENTS:
        raise ValueError(f"long_documents={long_documents!r}: choose 'split', 'refuse' or None (by document)")
    if whole_documents not in (None, True, False):
        raise ValueError(f"whole_documents={whole_documents!r}: choose True, False or None (by document)")
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # the current row's pieces
    filled = 0

    def emit() -> Row:
        nonlocal parts, filled
        if filled < seq_len:  # padding: a document of its own, nothing to predict
            pad = seq_len - filled
            parts.append((torch.full((pad,), pad_id), torch.full((pad,), ignore_index)))
        row = {
            "input_ids": torch.cat([ids for ids, _ in parts]),
            "labels": torch.cat([labels for _, labels in parts]),
            "position_ids": torch.cat([torch.arange(ids.numel()) for ids, _ in parts]),
        }
        parts, filled = [], 0
        return row

    for index, item in enumerate(documents):
        document = item if isinstance(item, Document) else Document(item)
        inputs, labels = _segment(document, index, ignore_index)
        if inputs.numel() == 0:
            continue  # one token: nothing to predict
        masked = document.has_loss_mask  # by default: kept whole, refused when longer than a row
        long_rule = long_documents or ("refuse" if masked else "split")
        if inputs.numel() > seq_len and long_rule == "refuse":
            raise ValueError(_too_long(index, inputs.numel(), seq_len, masked and long_documents is None))
        keep_whole = masked if whole_documents is None else whole_documents
        if keep_whole and filled and filled + inputs.numel() > seq_len:
            yield emit()  # it starts the next row whole (a longer-than-row one is cut below anyway)
        start = 0
        while start < inputs.numel():
            take = min(seq_len - filled, inputs.numel() - start)
            parts.append((inputs[start : start + take], labels[start : start + take]))
            filled, start = filled + take, start + take
            if filled == seq_len:
                yield emit()
    if filled:
        yield emit()


def _too_long(index: int, positions: int, seq_len: int, by_its_mask: bool) -> str:
    why = (
        ": it has a loss mask, and a piece of it would train an answer without its prompt. Raise seq_len, shorten "
        "or drop it, or pack with long_documents='split' to cut it anyway"
        if by_its_mask
        else ". Cut it yourself, raise seq_len, or pack with long_documents='split' (row-long pieces, each "
        "attending only itself)"
    )
    return (
        f"document {index} has {positions + 1} tokens, {positions} training positions: more than a row of "
        f"seq_len={seq_len}{why}"
    )


class PackedDataset(Dataset[Row]):
    """The rows of :func:`pack_documents` over a finite collection of documents, packed once, indexable: a
    ``DataLoader`` over it gets a distributed sampler under the strategy like any map-style dataset."""

    def __init__(
        self,
        documents: Iterable[Document | Sequence[int] | torch.Tensor],
        seq_len: int,
        *,
        pad_id: int = 0,
        ignore_index: int = -100,
        long_documents: LongDocuments | None = None,
        whole_documents: bool | None = None,
    ) -> None:
        self.rows = list(
            pack_documents(
                documents,
                seq_len,
                pad_id=pad_id,
                ignore_index=ignore_index,
                long_documents=long_documents,
                whole_documents=whole_documents,
            )
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]
