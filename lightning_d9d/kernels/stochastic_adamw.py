"""One ``StochasticAdamW`` step in one Triton pass: read the gradient, the weight (or its fp32 master) and both
moments, write them back, the bf16 results rounded stochastically with the same bits as the PyTorch path.

The reference is the optimizer's own chunked torch step (``StochasticAdamW._step_chunk`` beside
:mod:`lightning_d9d.optim.stochastic_rounding`, which owns the hash); this layer sits below the optimizers, so the
kernel restates the hash's 32-bit mixer and takes the per-step keys (:func:`stochastic_rounding.stream_key`) as
arguments. Per element the kernel reads 8 bytes and writes 6 with bf16 moments and no masters; the reference runs
each of its torch operations as a pass of its own over fp32 and int64 copies of a chunk.

Bit for bit the same results as the reference on CUDA: the fp32 math follows torch's CUDA kernels rounding for
rounding (each torch operation one rounding, except where nvcc fuses a multiply-add inside one: ``lerp_``,
``addcmul_``, ``addcdiv_``; the division by the bias correction a multiplication by its fp32 reciprocal, as torch
divides by a Python number on CUDA), so the kernel is compiled without fp fusion and fuses only those three,
explicitly. On CPU, torch divides truly and its vectorized ``sqrt`` is not correctly rounded, so the kernel in
Triton's interpreter agrees with the CPU reference to the bit only where those are exact (the CPU tests choose
such settings, and bound the difference elsewhere).

The global element index that keys each element's random bits is ``base + sum_d position_d * stride_d`` over the
local part's dims merged to at most three (:func:`global_index_layout`), ``position_d`` the local coordinate or,
for a dim under torch's strided sharding, a table of global positions: the index
:func:`lightning_d9d.optim.stochastic_rounding.flat_global_index` computes, without materializing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_d9d.kernels.adamw import AdamWHyper
from lightning_d9d.kernels.dispatch import launchable, use_triton
from lightning_d9d.kernels.triton_compat import tl, triton

BLOCK = 2048
INDEX_DIMS = 3
# tests/gpu/test_stochastic_adamw_gpu.py checks the kernel against the reference on a GPU; until it has passed
# there, ``auto`` keeps the reference on CUDA (``LIGHTNING_D9D_KERNELS=triton`` runs the kernel).
STOCHASTIC_ADAMW_GPU_CHECKED = False


@dataclass(frozen=True)
class GlobalIndex:
    """Where a local part's elements lie in the global tensor, as the kernel computes it: local flat position
    ``p``, split row-major over ``sizes`` into coordinates ``c_d``, has global index
    ``base + sum_d (tables[d][c_d] if tables[d] is not None else c_d) * strides[d]``."""

    base: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    tables: tuple[Tensor | None, ...]


def global_index_layout(
    offsets: list[int | Tensor], local_shape: tuple[int, ...], global_shape: tuple[int, ...]
) -> GlobalIndex | None:
    """The kernel's form of :func:`lightning_d9d.optim.stochastic_rounding.flat_global_index`'s index (the same
    ``offsets``: an int start per dim, or an int64 table of global positions), padded to three dims in front;
    None when more than three dims remain after merging. A dim of local size 1 adds its offset to ``base``; two
    neighbouring int dims merge where the inner one is whole in the global tensor, so a row shard (FSDP) or a
    whole tensor is one dim and a column shard (tp) two."""
    strides = [1] * len(global_shape)
    for dim in range(len(global_shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * global_shape[dim + 1]
    base = 0
    dims: list[tuple[int, int, Tensor | None]] = []
    for size, stride, offset in zip(local_shape, strides, offsets, strict=True):
        if isinstance(offset, Tensor):
            dims.append((size, stride, offset))
            continue
        base += offset * stride
        if size == 1:
            continue
        if dims and dims[-1][2] is None and dims[-1][1] == size * stride:
            outer = dims.pop()
            dims.append((outer[0] * size, stride, None))
        else:
            dims.append((size, stride, None))
    if len(dims) > INDEX_DIMS:
        return None
    dims = [(1, 0, None)] * (INDEX_DIMS - len(dims)) + dims
    sizes, dim_strides, tables = zip(*dims, strict=True)
    return GlobalIndex(base, tuple(sizes), tuple(dim_strides), tuple(tables))


@triton.jit
def _mix32(x):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    """The reference's ``_mix32`` on uint32 lanes (its ``& 0xFFFFFFFF`` is uint32 wrap-around here), with its
    multipliers (``stochastic_rounding._MULTIPLIERS``)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x68E31DA5
    return x ^ (x >> 16)


@triton.jit
def _bits16(index, key_low, key_high):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    """The reference's ``random_bits16``: 16 random bits (uint32) per int64 global index, for one stream's key."""
    low = index.to(tl.uint32)
    high = (index >> 32).to(tl.uint32)
    return _mix32(_mix32(low ^ key_low.to(tl.uint32)) ^ (high ^ key_high.to(tl.uint32))) >> 16


@triton.jit
def _round_bf16(value, bits):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    """The reference's ``stochastic_round_bf16``: the top half of (pattern + bits); infinities and NaN as they are."""
    pattern = value.to(tl.uint32, bitcast=True)
    rounded = ((pattern + bits) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    finite = (pattern & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, value.to(tl.bfloat16))


@triton.jit
def _nearest_bf16(value):  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    """``value`` rounded to the nearest bf16, ties to even, in integer steps (as torch's conversion; Triton's
    interpreter would truncate); infinities and NaN as they are."""
    pattern = value.to(tl.uint32, bitcast=True)
    rounded = ((pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    finite = (pattern & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, value.to(tl.bfloat16))


@triton.jit
def _position(coordinate, TABLE, mask, TABLED: tl.constexpr):  # type: ignore[no-untyped-def]  # pragma: no cover
    if TABLED:
        return tl.load(TABLE + coordinate, mask=mask, other=0)
    return coordinate


@triton.jit(do_not_specialize=["key_param_low", "key_param_high", "key_avg_low", "key_avg_high"])
def _stochastic_adamw_step(  # type: ignore[no-untyped-def]  # pragma: no cover (Triton)
    PARAM,
    GRAD,
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER,
    SCALE,
    TABLE0,
    TABLE1,
    TABLE2,
    n,
    size1,
    size2,
    stride0,
    stride1,
    stride2,
    base,
    key_param_low,
    key_param_high,
    key_avg_low,
    key_avg_high,
    key_avg_sq_low,
    key_avg_sq_high,
    lerp_weight,
    beta2,
    one_minus_beta2,
    eps,
    decay,
    neg_step_size,
    inverse_bias_correction2_sqrt,
    HAS_SCALE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    SMALL_LERP_WEIGHT: tl.constexpr,
    NDIMS: tl.constexpr,
    TABLED0: tl.constexpr,
    TABLED1: tl.constexpr,
    TABLED2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    # the global index (flat_global_index): coordinates of the (up to) three merged dims, innermost first
    if NDIMS == 1:
        index = base + _position(offsets, TABLE2, mask, TABLED2) * stride2
    elif NDIMS == 2:
        index = base + _position(offsets % size2, TABLE2, mask, TABLED2) * stride2
        index += _position(offsets // size2, TABLE1, mask, TABLED1) * stride1
    else:
        index = base + _position(offsets % size2, TABLE2, mask, TABLED2) * stride2
        rest = offsets // size2
        index += _position(rest % size1, TABLE1, mask, TABLED1) * stride1
        index += _position(rest // size1, TABLE0, mask, TABLED0) * stride0

    g = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(SCALE)
    if HAS_MASTER:
        weight = tl.load(MASTER + offsets, mask=mask, other=0.0)
    else:
        weight = tl.load(PARAM + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(EXP_AVG + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(EXP_AVG_SQ + offsets, mask=mask, other=0.0).to(tl.float32)

    weight = weight * decay  # mul_
    if SMALL_LERP_WEIGHT:  # lerp_, as torch's CUDA kernel computes it (nvcc fuses the multiply-add)
        m = tl.fma(lerp_weight, g - m, m)
    else:
        difference = g - m
        m = tl.fma(-difference, 1.0 - lerp_weight, g)
    v = v * beta2  # mul_
    v = tl.fma(one_minus_beta2, g * g, v)  # addcmul_: a + alpha * (b * c)
    denom = tl.sqrt_rn(v) * inverse_bias_correction2_sqrt  # sqrt, then / a Python number: * its reciprocal
    denom = denom + eps  # add_
    weight = tl.fma(neg_step_size, tl.div_rn(m, denom), weight)  # addcdiv_: a + alpha * (b / c)

    if EXP_AVG.dtype.element_ty == tl.bfloat16:
        tl.store(EXP_AVG + offsets, _round_bf16(m, _bits16(index, key_avg_low, key_avg_high)), mask=mask)
        tl.store(
            EXP_AVG_SQ + offsets, _round_bf16(v, _bits16(index, key_avg_sq_low, key_avg_sq_high)), mask=mask
        )
    else:
        tl.store(EXP_AVG + offsets, m, mask=mask)
        tl.store(EXP_AVG_SQ + offsets, v, mask=mask)
    if HAS_MASTER:  # the parameter is the master rounded to nearest
        tl.store(MASTER + offsets, weight, mask=mask)
        tl.store(PARAM + offsets, _nearest_bf16(weight), mask=mask)
    else:
        tl.store(
            PARAM + offsets, _round_bf16(weight, _bits16(index, key_param_low, key_param_high)), mask=mask
        )


def stochastic_adamw_step_triton(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    master: Tensor | None,
    hyper: AdamWHyper,
    keys: tuple[int, int, int],
    index: GlobalIndex,
    grad_scale: Tensor | None = None,
) -> None:
    """One step of a parameter's local part in place, in one Triton pass (every tensor contiguous, of one shape):
    ``param`` bf16, ``exp_avg`` / ``exp_avg_sq`` bf16 or fp32, ``master`` fp32 or None; ``keys`` the 64-bit
    rounding keys of the weight's, ``exp_avg``'s and ``exp_avg_sq``'s streams at this step; ``index`` where the
    elements lie in the global tensor (:func:`global_index_layout`)."""
    tensors = [param, grad, exp_avg, exp_avg_sq, *([master] if master is not None else [])]
    if any(t.shape != param.shape or not t.is_contiguous() for t in tensors):
        raise ValueError("stochastic_adamw_step_triton takes contiguous tensors of one shape")
    n = param.numel()
    if n == 0:
        return
    ndims = next(
        (INDEX_DIMS - d for d in range(INDEX_DIMS) if index.sizes[d] != 1 or index.tables[d] is not None),
        1,
    )
    tables = [table if table is not None else param for table in index.tables]  # (pointers never read)
    key_words = [word for key in keys for word in (key & 0xFFFFFFFF, key >> 32)]
    bias_correction2_sqrt = _fp32(hyper.bias_correction2_sqrt)
    lerp_weight = 1.0 - hyper.beta1
    launchable(_stochastic_adamw_step, param.device)[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        master if master is not None else param,
        grad_scale if grad_scale is not None else param,
        *tables,
        n,
        index.sizes[1],
        index.sizes[2],
        *index.strides,
        index.base,
        *key_words,
        lerp_weight,
        hyper.beta2,
        1.0 - hyper.beta2,
        hyper.eps,
        hyper.decay,
        -hyper.step_size,
        1.0 / bias_correction2_sqrt,  # fp32 1 / fp32 x, exactly rounded through a double (53 >= 2 * 24 + 2)
        grad_scale is not None,
        master is not None,
        abs(_fp32(lerp_weight)) < 0.5,
        ndims,
        *(table is not None for table in index.tables),
        BLOCK,
        num_warps=8,
        enable_fp_fusion=False,
    )


def use_stochastic_adamw_kernel(*tensors: Tensor) -> bool:
    """Whether the step of these (local, non-DTensor) tensors runs the Triton kernel: CUDA (or the interpreter
    under ``LIGHTNING_D9D_KERNELS=triton``), Triton installed, the kernel checked on a GPU for ``auto``, every
    tensor contiguous (see :mod:`lightning_d9d.kernels.dispatch`)."""
    return use_triton("stochastic_adamw_step", *tensors, gpu_checked=STOCHASTIC_ADAMW_GPU_CHECKED) and all(
        t.is_contiguous() for t in tensors
    )


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as torch turns a Python number into an fp32 operand)."""
    return float(torch.tensor(value, dtype=torch.float32))
