"""The fused LM head + cross-entropy equals full logits + cross-entropy (loss and both gradients) with ignored
tokens, ragged chunks and any reduction, never allocates a [tokens, vocab] tensor, and is what the causal LM
and the strategy use for ``causal_lm_loss``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d.kernels.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    default_chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lightning_d9d.loss import fused_causal_lm_loss
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import CausalLMLoss, causal_lm_loss


def per_token_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str
) -> torch.Tensor:
    """Token by token in float64 from the definition (-log softmax at the label): shares no code."""
    flat, ys = hidden.reshape(-1, hidden.shape[-1]).double(), labels.reshape(-1)
    losses = [
        -(flat[i] @ weight.double().t()).log_softmax(-1)[y] for i, y in enumerate(ys.tolist()) if y != -100
    ]
    if not losses:
        return (hidden.sum() + weight.sum()).double() * 0
    total = torch.stack(losses).sum()
    return total / len(losses) if reduction == "mean" else total


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _inputs(tokens: tuple[int, int] = (3, 37), hidden: int = 24, vocab: int = 101, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=generator, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=generator, requires_grad=True)
    y = torch.randint(0, vocab, tokens, generator=generator)
    y[0, :5] = -100
    y[-1, -1] = -100
    return h, w, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    ("chunk_tokens", "kernels"),
    [
        (1, "reference"),
        (16, "reference"),
        (37, "reference"),
        (1000, "reference"),
        (16, "triton"),
        (1000, "triton"),
    ],
)
def test_chunked_equals_the_definition(
    reduction: str, chunk_tokens: int, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kernels="triton"``: each chunk's softmax gradient by the Triton kernel (in the interpreter on CPU)."""
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", kernels)
    h, w, y = _inputs()
    loss = chunked_linear_cross_entropy(h, w, y, reduction=reduction, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(loss * 2.5, (h, w))  # a grad_output other than 1 must scale the gradients
    expected = per_token_reference(h, w, y, reduction)
    expected_grads = torch.autograd.grad(expected * 2.5, (h, w))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    for grad, want in zip(grads, expected_grads, strict=True):
        assert relative_error(grad, want) < 1e-5  # fp32 softmax: a few ulps of 2**-24 per term


def test_a_retained_graph_gives_the_same_gradients_twice() -> None:
    h, w, y = _inputs(seed=3)
    loss = chunked_linear_cross_entropy(h, w, y, chunk_tokens=16) * 2.5
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))  # the saved sums must not have been scaled in place
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("vocab", [101, 32000, 151936])
@pytest.mark.parametrize("tokens", [1, 127, 2048, 4097, 16384, 65536])
def test_default_chunks_are_as_few_as_allowed_and_even(vocab: int, tokens: int) -> None:
    longest = default_chunk_tokens(vocab)
    chunk = default_chunk_tokens(vocab, tokens)
    chunks = -(-tokens // chunk)
    assert chunk <= longest
    assert chunks == -(-tokens // longest)  # no more chunks than the longest allowed chunk needs
    assert (
        tokens - (chunks - 1) * chunk > chunk - chunks
    )  # the last chunk is as long as the others, up to rounding


def test_reference_and_dispatcher_agree_with_the_definition() -> None:
    h, w, y = _inputs(seed=1)
    expected = per_token_reference(h, w, y, "mean")
    for loss in (
        linear_cross_entropy_reference(h, w, y),
        linear_cross_entropy(h, w, y, backend="reference"),
        linear_cross_entropy(h, w, y),
    ):
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_equals_bf16_logits_with_fp32_softmax() -> None:
    h, w, y = _inputs(seed=2)
    h16, w16 = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    loss = chunked_linear_cross_entropy(h16, w16, y, chunk_tokens=16)
    ref = linear_cross_entropy_reference(h16, w16, y)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, fp32 softmax
    grads, ref_grads = torch.autograd.grad(loss, (h16, w16)), torch.autograd.grad(ref, (h16, w16))
    for grad, want in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.bfloat16
        assert relative_error(grad, want) < 1e-2  # bf16 rounding: 2**-8 per element


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_no_counted_token_gives_zero_not_nan(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", kernels)
    h, w, y = _inputs()
    loss = chunked_linear_cross_entropy(h, w, torch.full_like(y, -100), chunk_tokens=16)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_without_gradients(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", kernels)
    h, w, y = _inputs()
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, y, chunk_tokens=16)
    torch.testing.assert_close(loss.double(), per_token_reference(h, w, y, "mean"), rtol=1e-5, atol=1e-5)


class MatmulCount(TorchDispatchMode):
    """Counts the matrix products the ops run."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # matmul itself where no autograd key decomposes it (inference_mode)
        if func.overloadpacket in (
            torch.ops.aten.mm,
            torch.ops.aten.addmm,
            torch.ops.aten.bmm,
            torch.ops.aten.matmul,
        ):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_gradient_work_runs_only_when_autograd_needs_it(mode: str) -> None:
    """Under no_grad / inference_mode (every validation step) only the logits' matmul runs per chunk; with
    autograd, two more (the hidden and the weight gradients)."""
    h, w, y = _inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    chunks = -(-h.reshape(-1, h.shape[-1]).shape[0] // 16)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, contextlib.nullcontext
    )
    with context(), MatmulCount() as counted:
        chunked_linear_cross_entropy(h, w, y, chunk_tokens=16)
    assert counted.matmuls == (3 if mode == "grad" else 1) * chunks


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_never_allocates_full_logits() -> None:
    h, w, y = _inputs(tokens=(4, 64), hidden=8, vocab=300)
    with LargestAllocation() as chunked:
        chunked_linear_cross_entropy(h, w, y, chunk_tokens=32).backward()
    with LargestAllocation() as full:
        linear_cross_entropy_reference(h, w, y).backward()
    assert full.largest >= 256 * 300  # the mode sees the reference's logits
    assert chunked.largest <= 32 * 300  # one chunk's


def test_bad_inputs_are_named() -> None:
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="reduction='avg'"):
        chunked_linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="disagree on the token dims"):
        chunked_linear_cross_entropy(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        chunked_linear_cross_entropy(h, w, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="unknown linear cross-entropy backend 'x'"):
        linear_cross_entropy(h, w, y, backend="x")


@pytest.mark.parametrize("tied", [False, True])
def test_model_forward_loss_equals_logits_and_loss(tied: bool) -> None:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=tied))
    model.fuse_head_loss = True
    ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    labels[1, 3:] = 7  # -100 in the loss's ignore_index below: a custom ignore_index reaches the fused path
    loss_fn = CausalLMLoss(ignore_index=7)
    fused = fused_causal_lm_loss(model, (ids,), labels, loss_fn)
    assert fused is not None
    fused_grads = torch.autograd.grad(fused, list(model.parameters()))
    expected = loss_fn(model(ids), labels)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6)
    for grad, want in zip(fused_grads, expected_grads, strict=True):
        assert relative_error(grad, want) < 1e-5


def test_fusion_only_where_it_is_the_same_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    ids = labels = torch.randint(0, 256, (1, 4))
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None  # CPU: off by default
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "yes")
    with pytest.raises(ValueError, match="LIGHTNING_D9D_FUSED_LOSS='yes'"):
        fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss)
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is not None
    assert fused_causal_lm_loss(model, (ids,), labels, lambda o, t: causal_lm_loss(o, t)) is None
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss, tensor_parallel=True) is None
    assert fused_causal_lm_loss(torch.nn.Linear(2, 2), (ids,), labels, causal_lm_loss) is None
    model.fuse_head_loss = False
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None
