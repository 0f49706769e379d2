"""Fused LM head + cross-entropy: ``cross_entropy(hidden @ weight.T, labels)`` without ``[tokens, vocab]`` logits.

A causal LM's head and loss, done the plain way, keep the whole ``[tokens, vocab]`` logits, their fp32 upcast
and the softmax gradient alive at once: at vocab 151,936 and 16k tokens that is ~15 GiB. Here the tokens are
cut into chunks; each chunk's logits are computed, turned into its loss *and* its gradient
(``softmax - onehot``) right away, multiplied back into ``grad_hidden`` and accumulated into ``grad_weight``,
then freed. Only one chunk of logits exists at a time, and the backward pass has nothing left to do but scale
the saved gradients by the incoming one (the work of a recomputing backward saved: three matmuls, not four).

The numbers are those of the reference (:func:`linear_cross_entropy_reference`): logits in the inputs' dtype,
softmax in fp32, the sum of the per-token losses of labels that are not ``ignore_index`` divided by their
count (``reduction="mean"``; 0 with zero gradients when nothing is counted) or not divided (``"sum"``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton

REDUCTIONS = ("mean", "sum")
# Logits per chunk: 2**28 + 2**26 elements (0.625 GiB in bf16, plus twice that in fp32 on the torch path), 2176
# tokens at Qwen3's vocabulary. Measured on an H200 at 16384 tokens x vocab 151,936 (benchmarks/kernel_speed.py's
# chunk sweep, docs/benchmarks.md, run G2's raw results): 1024 / 2048 / 4096 / 8192-token chunks took 29.8 / 27.6 /
# 26.3 / 26.0 ms forward + backward at 0.93 / 1.19 / 1.77 / 2.93 GiB above the inputs (torch.compile of logits +
# CE: 27.4 ms at 4.96 GiB). Fewer chunks mean fewer fp32 weight-gradient accumulations, but each chunk's logits add
# to a training step's peak: twice the chunk saves ~1 ms for ~0.6 GiB more, so the chunk stays near 2048 tokens.
CHUNK_ELEMENTS = 2**28 + 2**26


def default_chunk_tokens(vocab: int, tokens: int | None = None) -> int:
    """Tokens per chunk: at most ``CHUNK_ELEMENTS / vocab`` rounded down to a multiple of 128 (at least 128).
    Given the ``tokens`` to cut, as few chunks as that allows, all of one length (16384 tokens at Qwen3's vocabulary:
    8 x 2048, not 7 x 2176 and a ragged 1152, whose small matmuls run slower)."""
    longest = max(128, (CHUNK_ELEMENTS // max(vocab, 1)) // 128 * 128)
    if tokens is None or tokens <= 0:
        return longest
    chunks = -(-tokens // longest)
    return -(-tokens // chunks)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose one of {REDUCTIONS}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: weight must be [vocab, hidden] "
            f"with hidden = hidden's last dim"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims"
        )
    if labels.dtype.is_floating_point:
        raise ValueError(f"labels must be integer class ids, got {labels.dtype}")


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """The plain way: full logits, fp32 cross-entropy (what ``CausalLMLoss`` computes on the head's logits)."""
    _check(hidden, weight, labels, reduction)
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.float(), flat, ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return total
    return total / (flat != ignore_index).sum().clamp(min=1)


def _chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for one chunk in torch ops: per-token losses (fp32, 0 where not kept) and
    ``(softmax - onehot) * scale`` in the logits' dtype."""
    logits32 = logits.float()
    target = torch.where(keep, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(logits32, dim=-1)
    losses = (lse - logits32.gather(1, target).squeeze(1)) * keep
    if not need_grad:
        return losses, logits
    grad = logits32.sub_(lse.unsqueeze(1)).exp_()  # in place: one fp32 chunk alive
    grad.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
    grad.mul_((keep.float() * scale).unsqueeze(1))
    return losses, grad.to(logits.dtype)


@triton.jit
def _softmax_ce_grad_kernel(  # type: ignore[no-untyped-def]
    LOGITS, LABELS, SCALE, LOSSES, vocab, stride, ignore_index, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - compiled by Triton
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    label = tl.load(LABELS + row)
    keep = label != ignore_index
    # pass 1: online max and sum of exp (fp32), and the label's logit
    running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.exp(x - safe)
        running_max = new_max
    top = tl.max(running_max, axis=0)
    lse = top + tl.log(tl.sum(running_sum * tl.exp(running_max - top), axis=0))
    target = tl.where(keep, label, 0)
    picked = tl.load(base + target).to(tl.float32)
    tl.store(LOSSES + row, tl.where(keep, lse - picked, 0.0))
    if WRITE_GRAD:
        # pass 2: (softmax - onehot) * scale, written over the logits in their dtype
        scale = tl.where(keep, tl.load(SCALE), 0.0)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def softmax_cross_entropy_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    *,
    write_grad: bool = True,
) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` ``[rows, vocab]`` (fp32, 0 for ignored rows), and with ``write_grad``
    the logits overwritten in place by ``(softmax - onehot) * scale`` (0 for ignored rows); ``scale`` is a
    0-d fp32 tensor (read on the device: no host synchronisation)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("softmax_cross_entropy_grad_ needs logits with unit stride over the vocabulary")
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    kernel = launchable(_softmax_ce_grad_kernel, logits.device)
    block = min(4096, triton.next_power_of_2(vocab))
    kernel[(rows,)](
        logits, labels.contiguous(), scale.reshape(1).float(), losses, vocab, logits.stride(0), ignore_index,
        write_grad, block, num_warps=8,
    )  # fmt: skip
    return losses


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in fp32 and ``a``, ``b`` in a low precision. On CUDA cuBLAS adds into ``acc``
    in its epilogue (``out_dtype=float32``): no ``[vocab, hidden]`` low-precision product is written and read
    back, which at Qwen3's vocabulary was a separate 0.6 ms pass per chunk. Elsewhere (no such kernel on CPU)
    the product is formed, then added."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        mean: bool,
        chunk_tokens: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        valid = labels != ignore_index
        # Scale of each token's gradient: 1/count for the mean (on the device: no host synchronisation).
        scale = 1.0 / valid.sum().clamp(min=1).float() if mean else hidden.new_ones((), dtype=torch.float32)
        # needs_input_grad says which inputs require grad, even under no_grad / inference_mode (validation):
        # the gradient work (softmax - one-hot, two matmuls, an fp32 [vocab, hidden] sum) only when autograd
        # will call backward
        need_hidden = grad_enabled and ctx.needs_input_grad[0]
        need_weight = grad_enabled and ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        fused = use_triton("linear_cross_entropy", hidden, weight)
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            h, y, keep = hidden[start:stop], labels[start:stop], valid[start:stop]
            logits = h @ weight.t()  # in the head's dtype, as the reference rounds them
            need_grad = need_hidden or need_weight
            if fused:  # one Triton pass: losses, and the logits overwritten by their gradient
                losses = softmax_cross_entropy_grad_(logits, y, scale, ignore_index, write_grad=need_grad)
                grad_low = logits
            else:
                losses, grad_low = _chunk_loss_and_grad(logits, y, keep, scale, need_grad)
            total = total + losses.sum()
            if not need_grad:
                continue
            if grad_hidden is not None:
                torch.matmul(grad_low, weight, out=grad_hidden[start:stop])
            if grad_weight is not None:
                _accumulate_matmul(grad_weight, grad_low.t(), h)
            del logits, grad_low
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            # Scaled after rounding to the weight's dtype, in place on that copy: no second [vocab, hidden] fp32
            # tensor at the start of backward, where a step's memory peaks (622 MB at Qwen3's vocabulary). The
            # saved sum stays unscaled (a retained graph may run backward again); a grad_output of 1 (or any
            # power of 2, as Lightning's accumulation divisors usually are) scales exactly.
            grad_weight = grad_weight.to(ctx.weight_dtype, copy=True).mul_(grad_output.to(ctx.weight_dtype))
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` over ``chunk_tokens`` tokens at a time (see the module
    docstring); ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` ``hidden``'s leading shape."""
    _check(hidden, weight, labels, reduction)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], flat_hidden.shape[0])
    loss: torch.Tensor = _ChunkedLinearCrossEntropy.apply(
        flat_hidden,
        weight,
        labels.reshape(-1),
        ignore_index,
        reduction == "mean",
        chunk,
        torch.is_grad_enabled(),
    )
    return loss


ENV_VAR = "LIGHTNING_D9D_LINEAR_CE"
BACKENDS = ("chunked", "reference")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    backend: str | None = None,
) -> torch.Tensor:
    """The LM head's loss by ``backend`` (else ``$LIGHTNING_D9D_LINEAR_CE``, else ``chunked``): ``chunked`` (any
    device; each chunk's softmax gradient in Triton on CUDA) or ``reference`` (full logits).

    ``cut-cross-entropy`` was measured beside it and is not offered (docs/benchmarks.md): fast only with its
    gradient filter (an approximation), 2.5x slower than ``chunked`` with exact gradients, and 1.1 % off the
    reference's gradients even then, past what bf16 rounding explains."""
    name = backend or os.environ.get(ENV_VAR) or "chunked"
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast (bf16-mixed without FSDP) the head runs in the autocast dtype, as a plain Linear
        # would; the chunks then need no autocast (their matmuls write into preallocated outputs, which
        # autocast refuses). The casts are differentiable: fp32 parameters get their gradients.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(
                hidden.to(dtype), weight.to(dtype), labels, ignore_index=ignore_index, reduction=reduction,
                backend=name,
            )  # fmt: skip
    if name == "chunked":
        return chunked_linear_cross_entropy(
            hidden, weight, labels, ignore_index=ignore_index, reduction=reduction
        )
    if name == "reference":
        return linear_cross_entropy_reference(
            hidden, weight, labels, ignore_index=ignore_index, reduction=reduction
        )
    raise ValueError(f"unknown linear cross-entropy backend {name!r}: choose one of {BACKENDS} (${ENV_VAR})")
