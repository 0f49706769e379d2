"""The ``torchao_fp8`` grouped GEMM backend: the experts' grouped GEMMs in float8 (e4m3, rowwise scales) through
torchao's MoE training kernels (``torchao.prototype.moe_training``), forward and both backward products.

torchao quantises each operand per row of its contraction (a token's row of ``x``, an expert's output column of
``w``; in backward, grad_output per token, and per expert and column over that expert's tokens for the weight
gradient), with power-of-two scales, and runs torch's ``_scaled_grouped_mm`` (CUTLASS, Hopper). It asks of its
inputs what this module arranges:

- group sizes that are multiples of 16: :func:`pad_groups` copies the rows into a buffer where each group starts
  on a multiple of 16, zero rows between (no host synchronisation: the buffer has a size known from the shapes,
  ``T + 15 * G`` rounded up to 16, and the slack joins the last group). Zero rows change no scale (an amax) and
  add nothing to the weight gradient; their outputs are dropped.
- ``w`` ``[G, K, N]`` column-major per group (strides ``(K * N, 1, K)``): our experts hold ``[G, K, N]``
  row-major (``modules/moe/experts.py``), so a row-major ``w`` is copied once into that layout
  (:func:`column_major`).
- ``K`` and ``N`` multiples of 16, bf16 or fp32 operands, CUDA with compute capability 9.0 or newer, and the
  ``torchao`` package (:func:`fp8_grouped_gemm_unsupported` says which is missing).

Registered by name only (``auto`` never picks it: it changes the numbers). The FP8 plan
(:func:`~lightning_d9d.plans.fp8.convert_experts_to_float8`) sets it on the experts it converts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

FLOAT8_BACKEND = "torchao_fp8"  # its name in the grouped GEMM registry
FP8_GROUP_ALIGNMENT = 16  # torchao's float8 grouped GEMM: group sizes, K and N multiples of 16
MIN_CAPABILITY = (9, 0)  # torch's _scaled_grouped_mm kernels: Hopper and newer
_TORCHAO_MODULE = "torchao.prototype.moe_training.fp8_grouped_mm"

# (A [M, K] row-major, B_t [G, K, N] column-major per group, offs [G] int32 group ends) -> [M, N]
PaddedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def torchao_fp8_importable() -> bool:
    """Whether torchao's MoE training package is installed (found without importing it: its import loads
    CUDA extensions, and a CPU run never needs it)."""
    try:
        return importlib.util.find_spec("torchao.prototype.moe_training") is not None
    except ModuleNotFoundError:  # torchao itself, or torchao.prototype, absent
        return False


_LOADED: dict[str, Callable[..., torch.Tensor] | None] = {}


def load_torchao_fp8() -> Callable[..., torch.Tensor] | None:
    """torchao's float8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``), imported on the first
    call; ``None`` where torchao cannot provide it. The FP8 plan calls it before compile traces the experts, so
    a compiled graph only reads the loaded function (a ``fullgraph`` compile cannot trace an import)."""
    if _TORCHAO_MODULE not in _LOADED:
        function = None
        if torchao_fp8_importable():
            from lightning_d9d.compat import import_private  # a private torchao name, listed there

            try:
                function = import_private(_TORCHAO_MODULE, "_to_fp8_rowwise_then_scaled_grouped_mm")
            except ImportError:  # a torchao without it, or without Triton (PrivateAPIError is an ImportError)
                function = None
        _LOADED[_TORCHAO_MODULE] = function
    return _LOADED[_TORCHAO_MODULE]


def fp8_grouped_gemm_unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the float8 grouped GEMM cannot run ``x [T, K]`` by ``w [G, K, N]`` (``None``: it can)."""
    if not x.is_cuda:
        return f"torchao's float8 grouped GEMM runs on CUDA only, got {x.device}"
    capability = torch.cuda.get_device_capability(x.device)
    if capability < MIN_CAPABILITY:
        return (
            f"torchao's float8 grouped GEMM needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"(Hopper) or newer, this GPU has {capability[0]}.{capability[1]}"
        )
    if x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != x.dtype:
        return f"torchao's float8 grouped GEMM takes bf16 or fp32 operands of one dtype, got {x.dtype} and {w.dtype}"
    if x.shape[1] % FP8_GROUP_ALIGNMENT or w.shape[2] % FP8_GROUP_ALIGNMENT:
        return (
            f"torchao's float8 grouped GEMM needs K ({x.shape[1]}) and N ({w.shape[2]}) to be multiples of "
            f"{FP8_GROUP_ALIGNMENT}"
        )
    if load_torchao_fp8() is None:
        return (
            "torchao's float8 grouped GEMM (torchao.prototype.moe_training) cannot be imported: pip install "
            "'lightning-d9d[fp8]' (torchao, with Triton)"
        )
    return None


def pad_groups(
    x: torch.Tensor, group_sizes: torch.Tensor, alignment: int = FP8_GROUP_ALIGNMENT
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x [T, K]`` (groups of ``group_sizes`` rows, consecutive) copied into ``padded [M, K]`` where every
    group starts on a multiple of ``alignment``, zeros between; returns ``(padded, rows, ends)``: ``rows [T]``
    is where each row of ``x`` went (``padded[rows] == x``) and ``ends [G]`` (int32) the padded groups' ends,
    all multiples of ``alignment``, the last one ``M``. ``M`` comes from the shapes alone (``T + (alignment - 1)
    * G`` rounded up), so nothing waits for the device; the slack is zero rows at the end of the last group.
    Differentiable in ``x``."""
    num_rows, num_groups = x.shape[0], group_sizes.shape[0]
    sizes = group_sizes.to(device=x.device, dtype=torch.int64)
    padded_sizes = (sizes + alignment - 1) // alignment * alignment
    padded_rows = -(-(num_rows + (alignment - 1) * num_groups) // alignment) * alignment
    starts = torch.cumsum(sizes, 0) - sizes
    padded_starts = torch.cumsum(padded_sizes, 0) - padded_sizes
    # each padded group ends where the next starts; the last one at padded_rows (the slack, a multiple of
    # alignment, is zero rows at its end)
    padded_ends = torch.cat([padded_starts[1:], padded_starts.new_full((1,), padded_rows)])
    row = torch.arange(num_rows, device=x.device)
    group = torch.searchsorted(starts + sizes, row, right=True)  # empty groups skipped: right=True
    rows = row + (padded_starts - starts)[group]
    padded = x.new_zeros(padded_rows, x.shape[1]).index_copy(0, rows, x)
    return padded, rows, padded_ends.to(torch.int32)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """``w [G, K, N]`` with strides ``(K * N, 1, K)``: itself if already so, else one copy."""
    if w.stride(1) == 1 and w.stride(2) == w.shape[1]:
        return w
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def padded_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, matmul: PaddedMatmul
) -> torch.Tensor:
    """``matmul`` (which takes torchao's layout: groups padded to 16, ``w`` column-major, int32 ends) as a
    :func:`~lightning_d9d.kernels.grouped_mm` over the rows of ``x`` grouped by ``group_sizes``."""
    padded, rows, ends = pad_groups(x.contiguous(), group_sizes)
    out = matmul(padded, column_major(w), ends)
    return out.index_select(0, rows)


def _torchao_matmul(dtype: torch.dtype) -> PaddedMatmul:
    scaled = load_torchao_fp8()
    if scaled is None:
        raise RuntimeError("torchao's float8 grouped GEMM cannot be imported (fp8_grouped_gemm_unsupported)")

    def run(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # our padding, not torchao's (its own asserts it is off); autocast off: the operands' dtype is the
        # output's, as in grouped_mm (which has cast them to autocast's dtype already)
        with torch.autocast(a.device.type, enabled=False):
            return scaled(a, b_t, offs, out_dtype=dtype, pad_token_groups_for_grouped_mm=False)

    return run


def torchao_fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The ``torchao_fp8`` backend: ``[T, K] x [G, K, N] -> [T, N]`` in float8 rowwise (module docstring). The
    registry has checked :func:`fp8_grouped_gemm_unsupported` on these inputs before it calls this."""
    return padded_grouped_mm(x, w, group_sizes, _torchao_matmul(x.dtype))
