"""Stochastic rounding from fp32 to bf16 with random bits that depend on the element, not on the layout.

A bf16 value is the top 16 bits of an fp32 pattern. Adding 16 uniform random bits to the low half of the pattern
and truncating rounds up with probability (low half) / 2**16, down otherwise: the expectation is the fp32 value
(unbiased), and the result is always one of its two bf16 neighbours.

The random bits are a counter-based hash of ``(seed, step, stream, global element index)``: no generator state to
carry, and the same element gets the same bits whichever rank holds it. For a DTensor the index is the element's
place in the global tensor (:func:`global_element_index`), so a parameter sharded over any mesh rounds bit for bit
as it does whole on one process, wherever the shards hold the same values.

Pure torch (int64 arithmetic, a few temporaries of the tensor's size): the reference a fused kernel is checked
against.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 tensors never overflow.
_MULTIPLIERS = (0x7FEB352D, 0x68E31DA5)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche mixer (xorshift-multiply, "lowbias32" style) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def _splitmix64(value: int) -> int:
    """Python-side mixing of the per-call key (seed, step, stream) into 64 well-spread bits."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


def random_bits16(index: Tensor, *, seed: int, step: int, stream: int) -> Tensor:
    """16 uniform random bits (int32 in [0, 2**16)) per element of ``index`` (int64 global element indices)."""
    key = _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ stream)
    low, high = key & _MASK32, key >> 32
    hashed = _mix32(_mix32((index & _MASK32) ^ low) ^ ((index >> 32) ^ high))
    return (hashed >> 16).to(torch.int32)


def stochastic_round_bf16(value: Tensor, bits16: Tensor) -> Tensor:
    """``value`` (fp32) rounded to bf16: up with probability (low 16 bits of its pattern) / 2**16, using the
    random ``bits16``. Infinities and NaNs pass unchanged; a finite value within one ulp of the largest rounds up
    to infinity with that probability, as rounding up does."""
    pattern = value.view(torch.int32)
    truncated = ((pattern + bits16) & -0x10000).view(torch.float32)  # -0x10000: ~0xFFFF as int32
    return torch.where(torch.isfinite(value), truncated, value).to(torch.bfloat16)


def global_element_index(tensor: Tensor) -> Tensor:
    """The flat index (int64, row-major in the global shape) of every element of ``tensor``'s local part: its
    ``to_local()`` for a DTensor, the tensor itself otherwise. Shaped like that local part.

    Each dim's local indices come from sharding that dim's index vector with the DTensor's own placements
    (``distribute_tensor`` with ``src_data_rank=None``: every rank splits its copy, no communication), so uneven
    and strided shards (FSDP over tensor parallelism) index as torch lays them out."""
    if not isinstance(tensor, DTensor):
        return torch.arange(tensor.numel(), dtype=torch.int64, device=tensor.device).view(tensor.shape)
    shape = tuple(tensor.shape)
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    local = tensor._local_tensor
    index = torch.zeros(local.shape, dtype=torch.int64, device=local.device)
    for dim, size in enumerate(shape):
        view = [1] * len(shape)
        view[dim] = size
        along = torch.arange(size, dtype=torch.int64, device=local.device).view(view)
        placements = [p if _shards(p, dim) else Replicate() for p in tensor.placements]
        if any(_shards(p, dim) for p in placements):
            along = distribute_tensor(along, tensor.device_mesh, placements, src_data_rank=None).to_local()
        index += along * strides[dim]
    return index


def _shards(placement: object, dim: int) -> bool:
    """Whether ``placement`` splits tensor dim ``dim`` (``_StridedShard`` is no ``Shard`` subclass in torch 2.13)."""
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim
