"""Packed rows: several documents in one row of tokens, told apart by ``position_ids`` that restart at 0.

The boundary format is the one RoPE needs anyway: each document's tokens count ``0, 1, 2, ...`` and the next
document starts at 0 again (``[0 1 2 3 0 1 0 1 2]`` is three documents of 4, 2 and 3 tokens). From it
:func:`document_ids` numbers the documents of a row (``[0 0 0 0 1 1 2 2 2]``) on the device, with no host
synchronisation, and attention lets a token see only the earlier tokens of its own document
(:func:`document_causal_mask`). Cumulative sequence lengths convert with :func:`position_ids_from_lengths`, and
back with :func:`document_cu_seqlens` (the varlen kernels' format, the rows laid end to end).

On CUDA the same mask goes to FlexAttention as a block-sparse :func:`document_block_mask`: blocks of 128 queries x
128 keys that hold no pair of one document are skipped, blocks inside one document run without a mask, and only
the blocks on a boundary evaluate it per element. It is built from the document numbers with a few tensor ops per
forward (``[B, T/128, T/128]`` work, no ``[T, T]`` tensor, no host synchronisation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` positions -> ``[..., T]`` int32 document numbers: how many documents started up to each token,
    minus one (a row whose first position is not 0 continues a document from elsewhere: its first tokens are
    document -1, a document of their own)."""
    return (position_ids == 0).cumsum(-1, dtype=torch.int32) - 1


def document_cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, T]`` positions -> (``cu_seqlens``, longest): the rows laid end to end as one batch of ``B * T`` tokens,
    in the varlen kernels' format: int32 ``[n + 1]`` offsets of the ``n`` documents (``[0, ..., B * T]``, on the
    positions' device), and the longest document's length. A document starts where a position is 0 and at every
    row's first token (rows never attend each other; a row that starts inside a document holds that document's
    tail, document -1 of :func:`document_ids`). One host synchronisation: the count of documents sets the tensor's
    length."""
    rows, length = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    offsets = starts.reshape(-1).cpu().nonzero().squeeze(1)  # the one synchronisation: [B * T] bools
    offsets = torch.cat((offsets, torch.tensor([rows * length])))
    longest = int((offsets[1:] - offsets[:-1]).max())
    return offsets.to(device=position_ids.device, dtype=torch.int32), longest


def document_causal_mask(documents: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` document numbers -> ``[B, 1, T, T]`` bool: query ``i`` may attend key ``j`` when ``j <= i`` and
    both lie in the same document (SDPA's boolean ``attn_mask``: True attends).

    ``queries`` (``[Tq]`` indices into the row) keeps only those queries' rows, ``[B, 1, Tq, T]``: a context-parallel
    rank's share of the same mask (its queries against every key), built without the other ranks' rows."""
    length = documents.shape[-1]
    if queries is None:
        queries = torch.arange(length, device=documents.device)
    causal = queries[:, None] >= torch.arange(length, device=documents.device)[None, :]
    same = documents.index_select(-1, queries)[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]


#: FlexAttention's block: the mask is described per ``BLOCK`` x ``BLOCK`` tile of (queries, keys).
BLOCK = 128


def document_block_mask(documents: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """``[B, T]`` document numbers (:func:`document_ids`: non-decreasing along each row, +1 at each start) ->
    FlexAttention's :class:`BlockMask` of :func:`document_causal_mask`, for a ``T`` divisible by ``block``.

    Tile (query block ``i``, key block ``j``) is *full* (every pair attends, no mask evaluated) when ``j < i`` and
    both blocks lie inside one and the same document; *partial* (the element mask decides) when ``j <= i`` and the
    two blocks share a document but are not full; else empty (skipped). Document numbers inside a block are
    consecutive integers, so two blocks share a document exactly when their ``[first, last]`` ranges overlap.
    """
    length = documents.shape[-1]
    if length % block != 0:
        raise ValueError(
            f"document_block_mask: the sequence length {length} must be a multiple of the block {block}; pad the "
            "rows to a multiple of it, or use the dense mask (document_causal_mask)"
        )
    blocks = length // block
    first = documents[:, ::block]  # [B, blocks]: the lowest document number of each block
    last = documents[:, block - 1 :: block]  # the highest
    q_first, q_last = first[:, :, None], last[:, :, None]  # query block i along dim 1
    k_first, k_last = first[:, None, :], last[:, None, :]  # key block j along dim 2
    index = torch.arange(blocks, device=documents.device)
    below, on_or_below = index[None, :] < index[:, None], index[None, :] <= index[:, None]
    shared = (k_first <= q_last) & (k_last >= q_first)
    full = below & (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
    partial = on_or_below & shared & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, 1, blocks] counts and [B, 1, blocks, blocks] key-block indices, the present ones first
        counts = tiles.sum(-1, dtype=torch.int32)
        indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None].contiguous(), indices[:, None].contiguous()

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (documents[b, q] == documents[b, k]) & (q >= k)

    partial_counts, partial_indices = ordered(partial)
    full_counts, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=block,
        mask_mod=same_document,
        seq_lengths=(length, length),
    )


def attended_keys(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions -> ``[B, T]`` int64: how many keys each query attends under
    :func:`document_causal_mask` (itself and the earlier tokens of its document): the work a kernel that skips
    masked pairs does for it. Counted from where each token's document starts in the row, not from the
    positions' values (a row may start inside a document whose positions do not start at 0)."""
    documents = document_ids(position_ids).contiguous()
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    # document numbers never decrease along a row: a document starts at the first index holding its number
    starts = torch.searchsorted(documents, documents, side="left")
    return index - starts + 1


def check_position_ids(position_ids: torch.Tensor) -> None:
    """Refuse positions that are not the boundary format: within a row each position is 0 (a document starts)
    or the previous one plus 1. A host check (it reads the tensor): for data pipelines and tests, not the
    training step."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, sequence], got shape {tuple(position_ids.shape)}")
    previous, current = position_ids[:, :-1], position_ids[:, 1:]
    wrong = ~((current == 0) | (current == previous + 1))
    if bool(wrong.any()):
        row, index = (int(i) for i in wrong.nonzero()[0])
        raise ValueError(
            f"position_ids[{row}, {index + 1}] = {int(current[row, index])} after {int(previous[row, index])}: "
            "within a packed row positions count up by one inside a document and restart at 0 for the next "
            "(lightning_d9d.data.pack_documents writes them so)"
        )


def position_ids_from_lengths(lengths: Sequence[int], row_length: int) -> torch.Tensor:
    """The ``[row_length]`` positions of a row holding documents of ``lengths`` tokens, in order (the
    cumulative-sequence-lengths format of varlen kernels, ``cu_seqlens = [0, *cumsum(lengths)]``)."""
    lengths = [int(n) for n in lengths]
    if any(n <= 0 for n in lengths):
        raise ValueError(f"document lengths must be positive, got {lengths}")
    if sum(lengths) != row_length:
        raise ValueError(
            f"document lengths {lengths} sum to {sum(lengths)}, not to the row's length {row_length}: pad the "
            "row with a last document (labels -100), or cut the last document"
        )
    return torch.cat([torch.arange(n) for n in lengths])
