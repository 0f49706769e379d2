"""FlashAttention 4 (``flash_attn.cute``, carried by ``benchmarks/carry_fa4.py``) on the GPU: the ``flash_attn4``
backend forward and backward against fp32 attention at the benchmark's shape, an attention block compiled whole
around it (no graph break, no recompile for a new batch), and packed rows through FA4's and flash-attn 2's varlen
kernels against the dense masked reference.

Skipped, with the reason, where ``flash_attn.cute`` is not importable or cannot run (no Hopper / Blackwell GPU);
``LIGHTNING_D9D_REQUIRE_FA4=1`` (set by ``benchmarks/h200_runs.sh fa4`` after its install) turns that skip into a
failure, so a run meant to test FA4 cannot pass without it.

The bound (as ``test_kernels_gpu.py``'s attention test, whose reasoning holds for any flash kernel): the reference
is fp32 softmax attention on the same bf16 inputs; a bf16 kernel rounds its output once (2**-9 relative) and, inside,
the probabilities before the PV matmul (another 2**-9), with fp32 accumulation; a few such roundings stay under
2**-7 of the output's norm. The backward adds the bf16 dO, P and dS operands of its four matmuls: 2**-6 for dq, dk,
dv (twice the output's band). A wrong mask, a dropped tile or a mis-indexed kv head moves the error to O(1).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_checks import grads, leaf, poisoned_allocations, relative_error

from lightning_d9d.kernels import flash_attn4 as fa4
from lightning_d9d.modules import Attention, RotaryEmbedding
from lightning_d9d.modules.attention import (
    VarlenDocuments,
    document_attention,
    document_attention_mask,
    select_attention_backend,
)
from lightning_d9d.modules.documents import document_causal_mask, document_ids, position_ids_from_lengths

pytestmark = pytest.mark.gpu
OUT_BOUND, GRAD_BOUND = 2**-7, 2**-6
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention


def require(kernel: str = "flash_attn4") -> None:
    """Skip (or, under ``LIGHTNING_D9D_REQUIRE_FA4=1``, fail) when ``kernel`` cannot run here."""
    probe = torch.zeros(1, 1, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    if kernel == "flash_attn4":
        reason = fa4.flash_attn4_unsupported(probe)
        hint = "benchmarks/carry_fa4.py carries it (benchmarks/README.md, 'FlashAttention 4')"
    else:
        from lightning_d9d.modules.attention import _flash_attn_unsupported

        reason = _flash_attn_unsupported(probe)
        hint = "benchmarks/build_kernels.sh builds it"
    if reason is None:
        return
    message = f"{kernel} cannot run here: it {reason} ({hint})"
    if kernel == "flash_attn4" and os.environ.get("LIGHTNING_D9D_REQUIRE_FA4") == "1":
        pytest.fail(message)
    pytest.skip(message)


def fp32_copies(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().float().requires_grad_(t.requires_grad) for t in tensors)


def bshd(batch: int, seq: int, heads: int, seed: int) -> torch.Tensor:
    """A ``[B, heads, T, D]`` leaf laid out as ``[B, T, heads, D]`` (what the attention block hands over)."""
    x = leaf(batch, seq, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda", seed=seed)
    return x.detach().transpose(1, 2).requires_grad_()


@pytest.mark.parametrize(("batch", "seq"), [(2, 1000), (2, 4096), (4, 4096)])
def test_flash_attn4_equals_fp32_attention(batch: int, seq: int) -> None:
    """The backend at the benchmark's shape (16 query heads on 8 key/value heads, head dim 128, causal, seq 4096;
    and an uneven length), forward and dq/dk/dv, outputs poisoned first."""
    require()
    q, k, v = bshd(batch, seq, HEADS, 21), bshd(batch, seq, KV_HEADS, 22), bshd(batch, seq, KV_HEADS, 23)
    backend = select_attention_backend(q, "flash_attn4")
    with poisoned_allocations():
        out = backend.run(q, k, v)
        got = grads((out,), (q, k, v))
    q32, k32, v32 = fp32_copies(q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    expected = grads((ref,), (q32, k32, v32))
    errors = [relative_error(out, ref), *(relative_error(g, e) for g, e in zip(got, expected, strict=True))]
    print(f"flash_attn4 B{batch} T{seq}: out, dq, dk, dv relative errors {[f'{e:.2e}' for e in errors]}")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert errors[0] < OUT_BOUND
    assert max(errors[1:]) < GRAD_BOUND


def test_a_compiled_block_on_flash_attn4_is_one_graph_and_compiles_once() -> None:
    """The 0.6B model's attention block on ``flash_attn4``, compiled with ``fullgraph=True`` (a graph break
    raises) by Inductor: as close to the fp32 block as the eager bf16 block is, and a second batch of the same
    shape compiles nothing.

    Compiled against eager directly is no bound: Inductor fuses the norms, RoPE and casts around the kernel in
    another order, and on an H200 the two bf16 blocks are 4.8e-3 apart, over one bf16 rounding
    (2**-8), while both are right. So each is held to the fp32 block (the same weights, fp32 math attention) and
    the compiled one may be at most twice as far from it as the eager one (the ratio flash-attention's own tests
    use against a bf16 reference); a wrong fake layout or a dropped operand in the graph is O(1) off."""
    require()
    torch.manual_seed(0)
    block = Attention(1024, HEADS, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    block.attention_backend = "flash_attn4"
    reference = copy.deepcopy(block).float()
    reference.attention_backend = "sdpa_math"
    rope = RotaryEmbedding(HEAD_DIM, 4096, 1_000_000.0, device="cuda")

    def step(module: torch.nn.Module, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope(None, 4096, dtype)
        # the same bf16 draws for both blocks (the reference computes on them exactly, in fp32)
        x = (
            leaf(2, 4096, 1024, dtype=torch.bfloat16, device="cuda", seed=seed)
            .detach()
            .to(dtype)
            .requires_grad_()
        )
        out = module(x, cos, sin)
        (dx,) = grads((out,), (x,))
        return out.detach(), dx

    want = step(reference, 30, torch.float32)
    eager = step(block, 30, torch.bfloat16)
    block.compile(fullgraph=True)
    compiled = step(block, 30, torch.bfloat16)
    torch._dynamo.config.error_on_recompile = True
    try:
        step(block, 31, torch.bfloat16)
    finally:
        torch._dynamo.config.error_on_recompile = False
    for name, got, base, ref in zip(("out", "dx"), compiled, eager, want, strict=True):
        compiled_error, eager_error = relative_error(got, ref), relative_error(base, ref)
        print(f"{name}: compiled {compiled_error:.2e}, eager {eager_error:.2e} from the fp32 block")
        assert eager_error < GRAD_BOUND, (name, eager_error)
        assert compiled_error <= 2 * eager_error, (name, compiled_error, eager_error)


def packed_positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Rows of documents of 1 to 1500 tokens; the last row starts inside a document (positions from 300) and holds
    one more, whose length (the longest of the batch) depends on the seed."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch - 1):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(min(int(torch.randint(1, 1500, (1,), generator=generator)), seq - sum(lengths)))
        rows.append(position_ids_from_lengths(lengths, seq))
    head = seq // 2 - 100 * seed
    rows.append(torch.cat([torch.arange(300, 300 + head), torch.arange(seq - head)]))
    return torch.stack(rows).cuda()


@pytest.mark.parametrize("kernel", ["flash_attn4", "flash_attn"])
def test_varlen_packed_rows_equal_the_dense_masked_attention(kernel: str) -> None:
    """Packed rows (documents of 1 to 1500 tokens, rows of 4096) through the varlen kernel, forward and backward,
    against fp32 SDPA with the dense block-diagonal causal mask, in the bound above."""
    require(kernel)
    positions = packed_positions(2, 4096, seed=8)
    documents = document_attention_mask(positions, kernel)
    assert isinstance(documents, VarlenDocuments) and documents.kernel == kernel
    q, k, v = bshd(2, 4096, HEADS, 24), bshd(2, 4096, KV_HEADS, 25), bshd(2, 4096, KV_HEADS, 26)
    with poisoned_allocations():
        out = document_attention(q, k, v, documents)
        got = grads((out,), (q, k, v))
    q32, k32, v32 = fp32_copies(q, k, v)
    mask = document_causal_mask(document_ids(positions))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, enable_gqa=True)
    expected = grads((ref,), (q32, k32, v32))
    errors = [relative_error(out, ref), *(relative_error(g, e) for g, e in zip(got, expected, strict=True))]
    print(f"{kernel} varlen ({len(documents.cu_seqlens) - 1} documents): out, dq, dk, dv {errors}")
    assert errors[0] < OUT_BOUND
    assert max(errors[1:]) < GRAD_BOUND


def test_a_compiled_qwen3_trains_packed_rows_on_flash_attn4_varlen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small Qwen3 (bf16, blocks compiled as the strategy compiles them) on packed rows with
    ``LIGHTNING_D9D_DOCUMENT_ATTENTION=flash_attn4``: its loss as the dense-mask path's (within bf16 averaging,
    the band of test_packed_gpu.py), and after the count of documents and the longest document have each changed
    once (a recompile each, then dynamic), a new batch compiles nothing."""
    require()
    from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
    from lightning_d9d.modules.loss import causal_lm_loss
    from lightning_d9d.plans import apply_compile

    torch.manual_seed(0)
    # positions reach 2047 in a row of 2048: the tiny shape's 512-position rotary table would be indexed past its end
    config = Qwen3Config.tiny(
        hidden_size=512,
        intermediate_size=1024,
        head_dim=HEAD_DIM,
        vocab_size=4000,
        max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(config).cuda().bfloat16()
    ids = torch.randint(1, 4000, (2, 2048), device="cuda")

    def loss(positions: torch.Tensor, path: str) -> float:
        monkeypatch.setenv("LIGHTNING_D9D_DOCUMENT_ATTENTION", path)
        value = causal_lm_loss(model(ids, positions), ids)
        value.backward()
        return float(value)

    first = packed_positions(2, 2048, seed=1)
    dense = loss(first, "sdpa")
    eager = loss(first, "flash_attn4")
    assert abs(eager - dense) / dense < 1e-3, (eager, dense)
    apply_compile(model.model.layers)
    shapes = set()
    for seed in (1, 2):  # the count of documents and the longest both change: each becomes dynamic
        positions = packed_positions(2, 2048, seed=seed)
        documents = document_attention_mask(positions, "flash_attn4")
        assert isinstance(documents, VarlenDocuments)
        shapes.add((len(documents.cu_seqlens), documents.max_seqlen))
        loss(positions, "flash_attn4")
    assert len({count for count, _ in shapes}) == 2 and len({longest for _, longest in shapes}) == 2, shapes
    torch._dynamo.config.error_on_recompile = True
    try:
        loss(packed_positions(2, 2048, seed=3), "flash_attn4")
    finally:
        torch._dynamo.config.error_on_recompile = False
