"""One AdamW step for a parameter kept twice: an fp32 master and the bf16 copy the model computes with.

Per element the step reads the master, the bf16 gradient and both fp32 moments, and writes the master, the
moments and the bf16 copy: 14 + 14 bytes, in one pass (:func:`adamw_master_step_triton`). An fp32 parameter
under bf16 autocast also moves 28 bytes in torch's fused AdamW, but pays two casts besides: the weight to bf16
in every forward (6 bytes) and its bf16 gradient back to fp32 in backward (6 bytes).

The math is ``torch.optim.AdamW``'s, in fp32 and in its order of operations (decoupled weight decay, then the
moments, then the bias-corrected update); the reference below is its single-tensor step, operation for
operation. ``grad_scale`` (a one-element fp32 tensor, e.g. gradient clipping's coefficient) multiplies the
gradient first, in fp32: clipping need not rewrite the bf16 gradients in a pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK = 4096
# tests/gpu/test_master_weights_gpu.py checks the kernel against the reference on a GPU, so ``auto`` runs it on
# CUDA (``LIGHTNING_D9D_KERNELS=torch`` keeps the reference).
ADAMW_MASTER_GPU_CHECKED = True


@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's AdamW settings at one step (``step`` counts from 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def decay(self) -> float:
        return 1.0 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return float((1.0 - self.beta2**self.step) ** 0.5)


def adamw_master_step_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """In place: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32) stepped by ``grad``, ``param`` the master rounded
    to its dtype. torch's single-tensor AdamW (``torch/optim/adamw.py``), operation for operation."""
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale
    master.mul_(hyper.decay)
    exp_avg.lerp_(g, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    denom = (exp_avg_sq.sqrt() / hyper.bias_correction2_sqrt).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.step_size)
    param.copy_(master)


@triton.jit
def _adamw_master_step(  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    MASTER,
    GRAD,
    EXP_AVG,
    EXP_AVG_SQ,
    PARAM,
    SCALE,
    n,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    decay,
    step_size,
    bias_correction2_sqrt,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    master = tl.load(MASTER + offsets, mask=mask, other=0.0)
    g = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(SCALE)
    m = tl.load(EXP_AVG + offsets, mask=mask, other=0.0)
    v = tl.load(EXP_AVG_SQ + offsets, mask=mask, other=0.0)
    master = master * decay
    m = m + one_minus_beta1 * (g - m)  # lerp with a weight below 0.5, as torch computes it
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    master = master - step_size * (m / denom)
    tl.store(MASTER + offsets, master, mask=mask)
    tl.store(EXP_AVG + offsets, m, mask=mask)
    tl.store(EXP_AVG_SQ + offsets, v, mask=mask)
    tl.store(PARAM + offsets, master.to(PARAM.dtype.element_ty), mask=mask)


def adamw_master_step_triton(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """:func:`adamw_master_step_reference` in one Triton pass (every tensor contiguous, of one shape)."""
    tensors = (master, grad, exp_avg, exp_avg_sq, param)
    if any(t.shape != master.shape or not t.is_contiguous() for t in tensors):
        raise ValueError("adamw_master_step_triton takes contiguous tensors of one shape")
    n = master.numel()
    scale = grad_scale if grad_scale is not None else master  # (a pointer the kernel never reads)
    launchable(_adamw_master_step, master.device)[(triton.cdiv(n, BLOCK),)](
        *tensors,
        scale,
        n,
        1.0 - hyper.beta1,
        hyper.beta2,
        1.0 - hyper.beta2,
        hyper.eps,
        hyper.decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
        grad_scale is not None,
        BLOCK,
        num_warps=8,
    )


def adamw_master_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW step of a master weight and its compute copy: Triton on CUDA once its GPU test has passed
    (``ADAMW_MASTER_GPU_CHECKED``), the reference elsewhere (see :mod:`lightning_d9d.kernels.dispatch`)."""
    tensors = (master, grad, exp_avg, exp_avg_sq, param)
    if use_triton("adamw_master_step", *tensors, gpu_checked=ADAMW_MASTER_GPU_CHECKED) and all(
        t.is_contiguous() for t in tensors
    ):
        adamw_master_step_triton(*tensors, hyper, grad_scale)
    else:
        adamw_master_step_reference(*tensors, hyper, grad_scale)
