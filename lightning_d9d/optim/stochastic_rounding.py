"""Stochastic rounding from fp32 to bf16 with random bits that depend on the element, not on the layout.

A bf16 value is the top 16 bits of an fp32 pattern. Adding 16 uniform random bits to the low half of the pattern
and truncating rounds up with probability (low half) / 2**16, down otherwise: the expectation is the fp32 value
(unbiased), and the result is always one of its two bf16 neighbours.

The random bits are a counter-based hash of ``(seed, step, stream, global element index)``: no generator state to
carry, and the same element gets the same bits whichever rank holds it. For a DTensor the index is the element's
place in the global tensor (:func:`global_element_index`), so a parameter sharded over any mesh rounds bit for bit
as it does whole on one process, wherever the shards hold the same values.

Pure torch (int64 arithmetic, a few temporaries of the size of the elements rounded at once: a caller bounds them
by rounding a large tensor in chunks, :func:`flat_global_index`): the reference a fused kernel is checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_d9d.compat import dtensor_global_offset, strided_shard_type

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


def stream_key(*, seed: int, step: int, stream: int) -> int:
    """The 64-bit key of one random stream at one step, which :func:`random_bits16` mixes with each index (and
    the fused kernel, :mod:`lightning_d9d.kernels.stochastic_adamw`, takes as it is)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ stream)


def random_bits16(index: Tensor, *, seed: int, step: int, stream: int) -> Tensor:
    """16 uniform random bits (int32 in [0, 2**16)) per element of ``index`` (int64 global element indices)."""
    key = stream_key(seed=seed, step=step, stream=stream)
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
    ``to_local()`` for a DTensor, the tensor itself otherwise. Shaped like that local part."""
    local = _local(tensor)
    offsets = axis_offsets(tensor)
    shape, local_shape = tuple(tensor.shape), tuple(local.shape)
    return flat_global_index(offsets, local_shape, shape, 0, local.numel(), local.device).view(local_shape)


def axis_offsets(tensor: Tensor) -> list[int | Tensor]:
    """Per dim of ``tensor``'s local part, where its local positions lie in the global tensor: an int ``start``
    where local position ``i`` is global ``start + i`` (a whole, replicated or ``Shard`` dim), else an int64
    vector of each local position's global position (a dim under ``_StridedShard``, FSDP over tensor
    parallelism: as long as that dim's local size, one matrix dim, never the tensor). :func:`flat_global_index`
    turns them into the elements' global indices.

    Contiguous starts come from torch's own offsets of the local shard. A strided dim's positions come from
    sharding that dim's index vector with the DTensor's own placements (``distribute_tensor`` with
    ``src_data_rank=None``: every rank splits its copy, no communication), so uneven and strided shards index as
    torch lays them out."""
    if not isinstance(tensor, DTensor):
        return [0] * tensor.dim()
    shape = tuple(tensor.shape)
    starts = dtensor_global_offset(shape, tensor.device_mesh, tensor.placements)
    offsets: list[int | Tensor] = list(starts)
    for dim, size in enumerate(shape):
        if not any(isinstance(p, strided_shard_type()) and p.dim == dim for p in tensor.placements):
            continue
        view = [1] * len(shape)
        view[dim] = size
        along = torch.arange(size, dtype=torch.int64, device=tensor._local_tensor.device).view(view)
        placements = [p if _shards(p, dim) else Replicate() for p in tensor.placements]
        shard = distribute_tensor(along, tensor.device_mesh, placements, src_data_rank=None).to_local()
        offsets[dim] = shard.reshape(-1)
    return offsets


def flat_global_index(
    offsets: list[int | Tensor],
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    start: int,
    end: int,
    device: torch.device,
) -> Tensor:
    """The global indices (int64, flat) of the local part's elements ``start`` to ``end`` in row-major order,
    from :func:`axis_offsets`: a few int64 temporaries of ``end - start`` elements, whatever the tensor's size,
    so a step that rounds a large shard chunk by chunk holds the indices of one chunk at a time."""
    position = torch.arange(start, end, dtype=torch.int64, device=device)
    if all(isinstance(offset, int) and offset == 0 for offset in offsets) and local_shape == global_shape:
        return position  # the whole tensor: local order is global order
    index = torch.zeros_like(position)
    stride = 1
    for dim in range(len(local_shape) - 1, -1, -1):
        size, offset = local_shape[dim], offsets[dim]
        coordinate = position % size if dim else position
        if isinstance(offset, int):
            index.add_(coordinate + offset, alpha=stride)
        else:
            index.add_(offset[coordinate], alpha=stride)
        if dim:
            position = position.div_(size, rounding_mode="floor")
        stride *= global_shape[dim]
    return index


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _shards(placement: object, dim: int) -> bool:
    """Whether ``placement`` splits tensor dim ``dim`` (``_StridedShard`` is no ``Shard`` subclass in torch 2.13)."""
    return isinstance(placement, (Shard, strided_shard_type())) and placement.dim == dim
