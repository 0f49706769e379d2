"""The Triton kernels and the fused LM-head loss at Qwen3-0.6B shapes, bf16, on one CUDA GPU: each equals its
PyTorch reference forward and backward, outputs poisoned with NaN first. Run on a CUDA GPU: ``pytest -m gpu``.

The references are run in fp32 on the same bf16 inputs (the exact answer the bf16 kernels round); the bound
is what bf16 rounding allows: each output element is rounded once or twice (2**-9 relative each), so the
norm-relative error of a correct kernel stays under 2**-8 for outputs and, with one more rounding of an
intermediate (the RMSNorm's normalised value, the SwiGLU's silu), under 2**-7 for gradients. The fused
cross-entropy is held to the bf16 logits + fp32 cross-entropy path it replaces, and to a quarter of its peak
memory.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_checks import grads, leaf, poisoned_allocations, relative_error

from lightning_d9d.kernels.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lightning_d9d.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from lightning_d9d.kernels.rope import rope_reference, rope_triton
from lightning_d9d.kernels.swiglu import (
    swiglu_reference,
    swiglu_triton,
    weighted_swiglu_reference,
    weighted_swiglu_triton,
)

pytestmark = pytest.mark.gpu
OUT_BOUND, GRAD_BOUND = 2**-8, 2**-7


def fp32_copies(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().float().requires_grad_(t.requires_grad) for t in tensors)


@pytest.mark.parametrize("shape", [(4, 4096, 1024), (4, 4096, 16, 128), (3, 1000, 8, 128), (5, 77, 1000)])
def test_rms_norm(shape: tuple[int, ...]) -> None:
    x = leaf(*shape, dtype=torch.bfloat16, device="cuda", seed=1)
    w = leaf(shape[-1], dtype=torch.bfloat16, device="cuda", seed=2, scale=0.1, shift=1.0)
    with poisoned_allocations():
        out = rms_norm_triton(x, w, 1e-6)
        got = grads((out,), (x, w))
    x32, w32 = fp32_copies(x, w)
    ref = rms_norm_reference(x32, w32, 1e-6)
    expected = grads((ref,), (x32, w32))
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) < OUT_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < GRAD_BOUND


@pytest.mark.parametrize("shape", [(4, 4096, 3072), (3, 1000, 1531)])
def test_swiglu(shape: tuple[int, ...]) -> None:
    gate = leaf(*shape, dtype=torch.bfloat16, device="cuda", seed=3)
    up = leaf(*shape, dtype=torch.bfloat16, device="cuda", seed=4)
    with poisoned_allocations():
        out = swiglu_triton(gate, up)
        got = grads((out,), (gate, up))
    gate32, up32 = fp32_copies(gate, up)
    ref = swiglu_reference(gate32, up32)
    expected = grads((ref,), (gate32, up32))
    assert relative_error(out, ref) < OUT_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < GRAD_BOUND


@pytest.mark.parametrize(("rows", "ffn"), [(131072, 384), (3001, 1531)])
def test_weighted_swiglu(rows: int, ffn: int) -> None:
    """The experts' SwiGLU with each row's routing weight, read in place from one ``[rows, 2 * ffn]`` projection,
    against fp32 (the MoE benchmark shape's 131,072 rows of 384, and a ragged one). Once it passes here,
    ``lightning_d9d.kernels.swiglu.WEIGHTED_SWIGLU_GPU_CHECKED`` may be set (``auto`` then runs it on CUDA)."""
    gate_up = leaf(rows, 2 * ffn, dtype=torch.bfloat16, device="cuda", seed=3)
    weights = leaf(rows, dtype=torch.bfloat16, device="cuda", seed=4, scale=0.1, shift=0.2)
    with poisoned_allocations():
        out = weighted_swiglu_triton(*gate_up.split(ffn, dim=-1), weights)
        got = grads((out,), (gate_up, weights))
    gate_up32, weights32 = fp32_copies(gate_up, weights)
    ref = weighted_swiglu_reference(*gate_up32.split(ffn, dim=-1), weights32)
    expected = grads((ref,), (gate_up32, weights32))
    assert relative_error(out, ref) < OUT_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < GRAD_BOUND


@pytest.mark.parametrize(
    ("batch", "q_heads", "k_heads", "seq", "head_dim", "table_batch"),
    [(4, 16, 8, 4096, 128, 1), (2, 12, 3, 1000, 96, 2)],
)
def test_rope(batch: int, q_heads: int, k_heads: int, seq: int, head_dim: int, table_batch: int) -> None:
    q = leaf(batch, seq, q_heads, head_dim, dtype=torch.bfloat16, device="cuda", seed=5).transpose(1, 2)
    k = leaf(batch, seq, k_heads, head_dim, dtype=torch.bfloat16, device="cuda", seed=6).transpose(1, 2)
    angles = torch.rand(table_batch, seq, head_dim // 2, device="cuda") * 1000
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    with poisoned_allocations():
        q_out, k_out = rope_triton(q, k, cos, sin)
        got = grads((q_out, k_out), (q, k))
    q32, k32 = fp32_copies(q, k)
    q_ref, k_ref = rope_reference(q32, k32, cos.float(), sin.float())
    expected = grads((q_ref, k_ref), (q32, k32))
    assert relative_error(q_out, q_ref) < OUT_BOUND and relative_error(k_out, k_ref) < OUT_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < OUT_BOUND  # one rounding: the rotation is linear


@pytest.mark.parametrize(("tokens", "hidden", "vocab"), [(16384, 1024, 151936), (3000, 1000, 50257)])
def test_fused_linear_cross_entropy(tokens: int, hidden: int, vocab: int) -> None:
    h = leaf(tokens, hidden, dtype=torch.bfloat16, device="cuda", seed=7)
    w = leaf(vocab, hidden, dtype=torch.bfloat16, device="cuda", seed=8, scale=0.02)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::7] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with poisoned_allocations():
        loss = chunked_linear_cross_entropy(h, w, labels)
        got = torch.autograd.grad(loss, (h, w))
    fused_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    ref = linear_cross_entropy_reference(h, w, labels)
    expected = torch.autograd.grad(ref, (h, w))
    plain_peak = torch.cuda.max_memory_allocated() - base
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())  # bf16 logits, fp32 softmax, both
    for grad, want in zip(got, expected, strict=True):
        assert grad.dtype == torch.bfloat16
        assert relative_error(grad, want) < GRAD_BOUND
    if vocab > 100_000:
        assert fused_peak <= plain_peak / 4, (fused_peak / 2**30, plain_peak / 2**30)


def skip_absent(package: str) -> None:
    """Skip (with the reason) a test of an optional package that is not importable here; fail instead under
    ``LIGHTNING_D9D_REQUIRE_BUILT=1``, which ``benchmarks/h200_runs.sh built`` sets after building them."""
    if importlib.util.find_spec(package) is None:
        message = f"{package} is not installed (benchmarks/build_kernels.sh builds it from source)"
        if os.environ.get("LIGHTNING_D9D_REQUIRE_BUILT") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.parametrize(("batch", "seq"), [(2, 1000), (1, 4096)])
@pytest.mark.parametrize(
    "name", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "sdpa", "flash_attn"]
)
def test_attention_backends_equal_fp32_attention(name: str, batch: int, seq: int) -> None:
    """Each backend, forward and backward, against fp32 attention at the model's heads (16 query heads on 8 key/
    value heads, head dim 128; ``flash_attn`` takes the grouped heads as they are, as cuDNN does), at an uneven
    length and at the benchmark's 4096."""
    from lightning_d9d.modules.attention import select_attention_backend

    if name == "flash_attn":  # flash-attn 2's extension: FA4's wheel installs a flash_attn package of its own
        skip_absent("flash_attn_2_cuda")
    if name == "sdpa_math" and seq > 2048:
        pytest.skip("the bf16 math path materialises [B, H, T, T]: covered at seq 1000")
    q = leaf(batch, 16, seq, 128, dtype=torch.bfloat16, device="cuda", seed=11)
    k = leaf(batch, 8, seq, 128, dtype=torch.bfloat16, device="cuda", seed=12)
    v = leaf(batch, 8, seq, 128, dtype=torch.bfloat16, device="cuda", seed=13)
    with poisoned_allocations():
        out = select_attention_backend(q, name).run(q, k, v)
        got = grads((out,), (q, k, v))
    q32, k32, v32 = fp32_copies(q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):  # the plain softmax(q k^T / sqrt(d)) v, in fp32
        ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    expected = grads((ref,), (q32, k32, v32))
    # bf16 inputs to the score and value matmuls, and bf16 softmax probabilities: a few roundings of 2**-9
    assert relative_error(out, ref) < GRAD_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < 2 * GRAD_BOUND


def test_auto_attention_on_hopper_is_fa4_or_cudnn() -> None:
    from lightning_d9d.kernels.flash_attn4 import flash_attn4_unsupported
    from lightning_d9d.modules.attention import select_attention_backend

    q = torch.zeros(1, 2, 4, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    expected = "sdpa_cudnn" if torch.cuda.get_device_capability()[0] >= 9 else "sdpa_flash"
    if hopper and flash_attn4_unsupported(q) is None:  # FA4 first on Hopper where it is installed
        expected = "flash_attn4"
    assert select_attention_backend(q).name == expected
    assert select_attention_backend(q.float()).name == "sdpa"


def test_qwen3_with_kernels_equals_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model on CUDA (Triton norms, SwiGLU, RoPE, cuDNN attention, fused loss) against the same model on the
    references, bf16: the loss and every parameter's gradient."""
    from lightning_d9d.loss import fused_causal_lm_loss
    from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
    from lightning_d9d.modules.loss import causal_lm_loss

    torch.manual_seed(0)
    config = Qwen3Config.tiny(hidden_size=256, intermediate_size=704, head_dim=64, vocab_size=5000)
    model = Qwen3ForCausalLM(config).cuda().bfloat16()
    ids = torch.randint(0, 5000, (2, 300), device="cuda")
    labels = torch.randint(0, 5000, (2, 300), device="cuda")
    labels[1, 200:] = -100
    results = {}
    for kernels in ("auto", "reference"):
        monkeypatch.setenv("LIGHTNING_D9D_KERNELS", kernels)
        monkeypatch.setenv("LIGHTNING_D9D_ATTENTION", "sdpa_math" if kernels == "reference" else "auto")
        monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1" if kernels == "auto" else "0")
        loss = fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss)
        if loss is None:
            loss = causal_lm_loss(model(ids), labels)
        results[kernels] = (loss.float(), torch.autograd.grad(loss, list(model.parameters())))
    (loss, got), (ref, expected) = results["auto"], results["reference"]
    assert abs(loss.item() - ref.item()) <= 1e-2 * ref.item()
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < 5e-2  # bf16 through 2 layers, rounded in different places


@pytest.mark.parametrize(
    ("tokens", "hidden", "top_k", "experts"), [(16384, 1024, 8, 128), (3001, 1000, 2, 6)]
)
def test_moe_permutation(
    tokens: int, hidden: int, top_k: int, experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton permute/unpermute against the references (forced by name: ``auto`` waits for this test, see
    ``lightning_d9d.kernels.permute.PERMUTE_GPU_CHECKED``)."""
    from lightning_d9d.kernels import permute_tokens, unpermute_tokens

    x = leaf(tokens, hidden, dtype=torch.bfloat16, device="cuda", seed=14)
    scores = torch.rand(tokens, experts, device="cuda")
    indices = scores.topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device="cuda").requires_grad_()
    scale = torch.randn(experts, hidden, device="cuda").bfloat16()
    results = {}
    # bf16 both ways, and the reference in fp32 as the truth: the combine sums top_k bf16 products, rounding
    # after each add in bf16 (2^-9 each, ~sqrt(top_k) of them), so each path must be within 2^-7 of fp32.
    for kernels, dtype in (
        ("triton", torch.bfloat16),
        ("reference", torch.bfloat16),
        ("fp32", torch.float32),
    ):
        monkeypatch.setenv("LIGHTNING_D9D_KERNELS", "triton" if kernels == "triton" else "reference")
        inputs = x.detach().to(dtype).requires_grad_(), weights.detach().requires_grad_()
        with poisoned_allocations():
            grouped, permutation = permute_tokens(inputs[0], indices)
            out = unpermute_tokens(
                grouped * scale.to(dtype)[indices.reshape(-1)[permutation.order]], permutation, inputs[1]
            )
            results[kernels] = (grouped, out, *grads((out,), inputs))
    assert torch.equal(results["triton"][0], results["reference"][0])
    for kernels in ("triton", "reference"):
        errors = [
            relative_error(got, want)
            for got, want in zip(results[kernels][1:], results["fp32"][1:], strict=True)
        ]
        print(f"{kernels} permute/unpermute vs fp32 (out, dx, dweights): {[f'{e:.2e}' for e in errors]}")
        assert max(errors) < GRAD_BOUND, (kernels, errors)


# Qwen3-MoE-like (128 experts, width 768), the MoE benchmark's (64 experts, hidden 1024, width 384, top-8 of 16384
# tokens: the up projection's gate+up is 768 wide, the down projection 384 -> 1024), and an uneven one.
GROUPED_SHAPES = [
    (128, 1024, 768, 32768),
    (64, 1024, 768, 16384 * 8),
    (64, 384, 1024, 16384 * 8),
    (6, 1000, 300, 5001),
]


@pytest.mark.parametrize("layout", ["KN", "NK"])
@pytest.mark.parametrize(("experts", "k", "n", "rows"), GROUPED_SHAPES)
@pytest.mark.parametrize("backend", ["triton", "grouped_gemm", "torch"])
def test_grouped_gemm_backends(backend: str, experts: int, k: int, n: int, rows: int, layout: str) -> None:
    """Each grouped GEMM backend against a per-group fp32 loop, forward and backward, empty groups included,
    outputs poisoned. ``layout`` ``NK``: ``w`` is the transposed view of a contiguous ``[G, N, K]``
    (transformers' expert layout). A backend that cannot run the shape must refuse it by name (the bound:
    bf16 operands, fp32 accumulation, one rounding of the result, as for the other kernels here)."""
    from lightning_d9d.kernels import grouped_mm
    from lightning_d9d.kernels.grouped_gemm import select_grouped_gemm_backend

    if backend == "grouped_gemm":
        skip_absent("grouped_gemm")
    generator = torch.Generator().manual_seed(experts)
    weights = torch.rand(experts, generator=generator)
    weights[::5] = 0  # experts without tokens
    sizes = torch.distributions.Multinomial(rows, probs=weights / weights.sum()).sample().to(torch.int64)
    x = leaf(rows, k, dtype=torch.bfloat16, device="cuda", seed=15)
    w = leaf(experts, k, n, dtype=torch.bfloat16, device="cuda", seed=16, scale=0.03)
    if layout == "NK":
        w = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    # A refusal: e.g. 300 bf16 columns are not the 16-byte rows torch's or the package's kernel loads.
    try:
        select_grouped_gemm_backend(x, w, backend)
    except ValueError as refusal:
        assert "multiple" in str(refusal) and (k % 8 or n % 8), refusal
        return
    with poisoned_allocations():
        out = grouped_mm(x, w, sizes.cuda(), backend=backend)
        got = grads((out,), (x, w))
    x32, w32 = fp32_copies(x, w)
    ref = torch.cat([block @ w32[g] for g, block in enumerate(x32.split(sizes.tolist()))])
    expected = grads((ref,), (x32, w32))
    errors = [relative_error(out, ref), *(relative_error(g, e) for g, e in zip(got, expected, strict=True))]
    print(f"{backend} {experts}x{k}x{n} rows {rows} {layout}: out, dx, dw {[f'{e:.2e}' for e in errors]}")
    assert errors[0] < OUT_BOUND
    assert max(errors[1:]) < GRAD_BOUND
    assert got[1].shape == w.shape


def test_grouped_gemm_package_with_device_sizes() -> None:
    """The package's CUTLASS build also takes the group sizes on the device (no host synchronisation), which our
    backend does not use yet: this says whether that path is right at the MoE benchmark's shape."""
    skip_absent("grouped_gemm")
    ops = importlib.import_module("grouped_gemm.ops")
    experts, k, n, rows = 64, 1024, 768, 16384 * 8
    generator = torch.Generator().manual_seed(3)
    weights = torch.rand(experts, generator=generator)
    weights[::5] = 0
    sizes = torch.distributions.Multinomial(rows, probs=weights / weights.sum()).sample().to(torch.int64)
    x = leaf(rows, k, dtype=torch.bfloat16, device="cuda", seed=17)
    w = leaf(experts, k, n, dtype=torch.bfloat16, device="cuda", seed=18, scale=0.03)
    try:
        with poisoned_allocations():
            out = ops.gmm(x, w, sizes.cuda(), trans_b=False)
            got = grads((out,), (x, w))
    except RuntimeError as error:
        if "is_cpu" in str(error):
            pytest.skip(
                "this grouped_gemm build is the cuBLAS one (GROUPED_GEMM_CUTLASS unset): host sizes only"
            )
        raise
    x32, w32 = fp32_copies(x, w)
    ref = torch.cat([block @ w32[g] for g, block in enumerate(x32.split(sizes.tolist()))])
    expected = grads((ref,), (x32, w32))
    assert relative_error(out, ref) < OUT_BOUND
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < GRAD_BOUND
