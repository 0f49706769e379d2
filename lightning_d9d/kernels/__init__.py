"""Kernels with pure-PyTorch references beside them: grouped GEMM and MoE token permutation, the fused LM-head
cross-entropy, RMSNorm, SwiGLU and rotary embedding.

Fast paths (Triton on CUDA, the optional ``grouped_gemm`` package) are chosen at call time
(:mod:`lightning_d9d.kernels.dispatch`); a missing package is never an import error. This layer imports only
``compat`` and ``mesh`` from lightning_d9d.
"""

from lightning_d9d.kernels.grouped_gemm import (
    GroupedGemmBackend,
    grouped_gemm_backends,
    grouped_mm,
    loop_grouped_mm,
    register_grouped_gemm_backend,
    select_grouped_gemm_backend,
)
from lightning_d9d.kernels.linear_cross_entropy import linear_cross_entropy
from lightning_d9d.kernels.permute import (
    Permutation,
    count_tokens_per_expert,
    permute_tokens,
    unpermute_tokens,
    weigh_rows,
    weights_by_row,
)
from lightning_d9d.kernels.rmsnorm import rms_norm
from lightning_d9d.kernels.rope import apply_rope
from lightning_d9d.kernels.swiglu import swiglu

__all__ = [
    "GroupedGemmBackend",
    "Permutation",
    "apply_rope",
    "count_tokens_per_expert",
    "grouped_gemm_backends",
    "grouped_mm",
    "linear_cross_entropy",
    "loop_grouped_mm",
    "permute_tokens",
    "register_grouped_gemm_backend",
    "rms_norm",
    "select_grouped_gemm_backend",
    "swiglu",
    "unpermute_tokens",
    "weigh_rows",
    "weights_by_row",
]
