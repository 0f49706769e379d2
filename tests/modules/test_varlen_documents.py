"""Packed rows through a varlen kernel (``LIGHTNING_D9D_DOCUMENT_ATTENTION=flash_attn4`` / ``flash_attn``): the
rows laid end to end as one batch of documents. On CPU: ``cu_seqlens`` against the document numbers, exactly; the
varlen path through FlashAttention 4's operators (its interface replaced by the CPU stand-in of
``tests/kernels/fa4_reference.py``) equals the dense masked attention, forward and backward, eager and in one
compiled graph; and what the paths refuse. The kernels themselves: tests/gpu/test_flash_attn4_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import itertools

import fa4_reference
from test_documents import ROWS, _random_rows

from lightning_d9d.kernels import flash_attn4 as fa4
from lightning_d9d.modules import Attention, RotaryEmbedding
from lightning_d9d.modules import attention as attention_module
from lightning_d9d.modules.attention import VarlenDocuments, document_attention, document_attention_mask
from lightning_d9d.modules.documents import (
    document_causal_mask,
    document_cu_seqlens,
    document_ids,
    position_ids_from_lengths,
)


def _expected_offsets(positions: torch.Tensor) -> list[int]:
    """Where a new (row, document) pair starts, walking the rows end to end, token by token."""
    documents = document_ids(positions).tolist()
    offsets = []
    for row, numbers in enumerate(documents):
        for i, number in enumerate(numbers):
            if i == 0 or number != numbers[i - 1]:
                offsets.append(row * positions.shape[1] + i)
    return [*offsets, positions.numel()]


@pytest.mark.parametrize("positions", [ROWS, _random_rows(2, 6, 512)], ids=["hand-made", "random"])
def test_cu_seqlens_are_the_documents_of_the_rows_end_to_end(positions: torch.Tensor) -> None:
    cu_seqlens, longest = document_cu_seqlens(positions)
    expected = _expected_offsets(positions)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == expected
    assert longest == max(b - a for a, b in itertools.pairwise(expected))
    if positions is ROWS:  # a row starting inside a document starts a sequence; so does every row
        assert expected == [0, 4, 6, 12, 14, 19, 21, 23, 24, 36]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    fa4_reference.install(monkeypatch)
    monkeypatch.setattr(fa4, "flash_attn4_unsupported", lambda q: None)  # no CUDA here


def _qkv(positions: torch.Tensor, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> list[torch.Tensor]:
    """[B, H, T, D] views of [B, T, H, D] tensors, as the attention block hands them over."""
    generator = torch.Generator().manual_seed(5)
    batch, length = positions.shape
    shapes = [(batch, length, h, dim) for h in (heads, kv_heads, kv_heads)]
    return [torch.randn(*s, generator=generator).transpose(1, 2).requires_grad_() for s in shapes]


def test_the_varlen_path_is_the_dense_masked_attention(stand_in: None) -> None:
    positions = _random_rows(4, 4, 300)
    q, k, v = _qkv(positions)
    documents = VarlenDocuments(*document_cu_seqlens(positions), "flash_attn4")
    out = document_attention(q, k, v, documents, scale=0.2)
    dense = document_attention(q, k, v, document_causal_mask(document_ids(positions)), scale=0.2)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(out, (q, k, v), dense.detach())
    want = torch.autograd.grad(dense, (q, k, v), dense.detach())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert fa4_reference.CALLS == ["varlen forward", "backward"]


def test_a_compiled_block_attends_varlen_documents_in_one_graph(stand_in: None) -> None:
    """``VarlenDocuments`` reaches a block compiled with ``fullgraph=True`` as an input. Its two varying parts (the
    count of documents, ``cu_seqlens``' length, and the longest document) each cost one recompile the first time
    they change, after which Dynamo keeps them dynamic: later batches compile nothing."""
    torch.manual_seed(0)
    block = Attention(32, 4, 2, 8)
    cos, sin = RotaryEmbedding(8, 64, 10000.0)(None, 12, torch.float32)
    x = torch.randn(3, 12, 32)
    layouts = [  # (documents per row): 9 documents, longest 12; then 6 of 6; then others, after both changed
        ROWS,
        _positions([[6, 6], [6, 6], [6, 6]]),
        _positions([[3, 9], [12], [4, 4, 2, 2]]),
        _positions([[1] * 12, [11, 1], [5, 7]]),
    ]
    eager = []
    for positions in layouts:
        documents = VarlenDocuments(*document_cu_seqlens(positions), "flash_attn4")
        eager.append(block(x, cos, sin, documents))
        dense = block(x, cos, sin, document_causal_mask(document_ids(positions)))
        torch.testing.assert_close(eager[-1], dense, rtol=1e-5, atol=1e-5)
    block.compile(fullgraph=True, backend="aot_eager")
    for i, positions in enumerate(layouts):
        documents = VarlenDocuments(*document_cu_seqlens(positions), "flash_attn4")
        torch._dynamo.config.error_on_recompile = i >= 2
        try:
            torch.testing.assert_close(block(x, cos, sin, documents), eager[i], rtol=1e-5, atol=1e-5)
        finally:
            torch._dynamo.config.error_on_recompile = False


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([position_ids_from_lengths(lengths, sum(lengths)) for lengths in rows])


def test_the_varlen_paths_are_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    positions = ROWS
    monkeypatch.setattr(fa4, "INSTALLED", False)
    with pytest.raises(
        ValueError, match=r"'flash_attn4' cannot run these rows: it needs the flash-attn-4 package"
    ):
        document_attention_mask(positions, "flash_attn4")
    monkeypatch.setattr(fa4, "INSTALLED", True)
    with pytest.raises(
        ValueError, match=r"'flash_attn4' cannot run these rows: it runs on CUDA only, got cpu"
    ):
        document_attention_mask(positions, "flash_attn4")
    monkeypatch.setattr(attention_module, "_FLASH_ATTN_INSTALLED", False)
    monkeypatch.setenv("LIGHTNING_D9D_DOCUMENT_ATTENTION", "flash_attn")
    with pytest.raises(
        ValueError, match=r"'flash_attn' cannot run these rows: it needs the flash-attn \(2\)"
    ):
        document_attention_mask(positions)
    monkeypatch.delenv("LIGHTNING_D9D_DOCUMENT_ATTENTION")
    assert isinstance(document_attention_mask(positions), torch.Tensor)  # auto: never a varlen kernel
    # the queries are checked when attention runs: fp32 on CPU is not FA4's
    q, k, v = _qkv(positions)
    documents = VarlenDocuments(*document_cu_seqlens(positions), "flash_attn4")
    with pytest.raises(
        ValueError, match=r"'flash_attn4' cannot run torch.float32 queries of head dim 8 on cpu"
    ):
        document_attention(q, k, v, documents)
    block = Attention(32, 4, 2, 8)
    block.context = lambda q, k, v, mask=None: q
    cos, sin = RotaryEmbedding(8, 64, 10000.0)(None, 12, torch.float32)
    with pytest.raises(TypeError, match="takes the dense document mask, not a VarlenDocuments"):
        block(torch.randn(3, 12, 32), cos, sin, documents)
