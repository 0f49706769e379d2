"""Kernels with pure-PyTorch references and backend registries: grouped GEMM and MoE token permutation.

Optional fast paths (``grouped_gemm``, later Triton) are chosen at call time; a missing package is never an
import error. This layer imports only ``compat`` and ``mesh`` from lightning_d9d.
"""

from lightning_d9d.kernels.grouped_gemm import (
    GroupedGemmBackend,
    grouped_gemm_backends,
    grouped_mm,
    loop_grouped_mm,
    register_grouped_gemm_backend,
    select_grouped_gemm_backend,
)
from lightning_d9d.kernels.permute import (
    Permutation,
    count_tokens_per_expert,
    permute_tokens,
    unpermute_tokens,
)

__all__ = [
    "GroupedGemmBackend",
    "Permutation",
    "count_tokens_per_expert",
    "grouped_gemm_backends",
    "grouped_mm",
    "loop_grouped_mm",
    "permute_tokens",
    "register_grouped_gemm_backend",
    "select_grouped_gemm_backend",
    "unpermute_tokens",
]
