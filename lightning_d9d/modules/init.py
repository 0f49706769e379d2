"""Sharding-independent parameter initialisation.

Every parameter is drawn in full, on CPU, in fp32, from a generator seeded by ``(seed, parameter name)``, then
cast and (for a ``DTensor``) cut down to this rank's shard without communication. The result depends only
on the seed and the name: not on the mesh, the number of ranks, the order modules are visited, the device,
or the global RNG (which is left untouched). A model built on ``meta``, sharded, ``to_empty``'d and
initialised therefore holds bitwise the same weights as one built whole on one process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_d9d.compat import WRAPPER_PREFIXES

Fill = Callable[[torch.Tensor, torch.Generator], None]


def canonical_param_name(name: str) -> str:
    """``name`` without the components that activation checkpointing / compile / FSDP1 wrappers add."""
    for prefix in WRAPPER_PREFIXES:  # the seed must not depend on wrappers
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``(seed, canonical name)``, stable across processes and Python versions
    (unlike ``hash()``, which is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{canonical_param_name(name)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def normal_fill(std: float, mean: float = 0.0) -> Fill:
    def fill(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.normal_(mean, std, generator=generator)

    return fill


def ones_fill(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.fill_(1.0)


def zeros_fill(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.zero_()


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, fill: Fill) -> None:
    """Overwrite ``param`` (plain tensor or ``DTensor``) in place with ``fill`` applied to a fresh full-size
    fp32 CPU tensor, seeded from ``(seed, name)``.

    For a ``DTensor`` every rank draws the full tensor and keeps its own shard (``src_data_rank=None``: no
    collective), which is what makes the result independent of the placement.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(param_seed(seed, name))
    full = torch.empty(tuple(param.shape), dtype=torch.float32, device="cpu")
    fill(full, generator)
    assign_full_(param, full)


@torch.no_grad()
def assign_full_(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Overwrite ``tensor`` (plain or ``DTensor``) in place with the full-size ``full``, cast to its dtype: a
    ``DTensor`` keeps this rank's piece of it, cut locally (every rank holds ``full``; no collective)."""
    full = full.to(tensor.dtype)
    if isinstance(tensor, DTensor):
        shard = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        tensor.to_local().copy_(shard)
    else:
        tensor.copy_(full)
