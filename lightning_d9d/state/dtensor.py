"""Mappers between full tensors and DTensors: ``Distribute`` (no communication) and ``Gather`` (a collective).

``torch.distributed.tensor`` is imported lazily so that the rest of ``state`` works on builds without
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard

from torch import Tensor, nn

from .errors import NotInvertibleError
from .mapper import _KeyWise

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

PlacementSpec = tuple["DeviceMesh", Sequence["Placement"]]


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def distribute_full(tensor: Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """This rank's DTensor of ``tensor``, which every rank holds in full: slicing only, no communication."""
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank already has the same full tensor (each one read the checkpoint), so
    # take the local slice instead of scattering from a source rank.
    return distribute_tensor(tensor, mesh, list(placements), src_data_rank=None)


def full_tensor(tensor: Tensor) -> Tensor:
    """The full value of a DTensor (a collective: every rank of its mesh must call it), or ``tensor`` itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


class Distribute(_KeyWise):
    """Turn full tensors into DTensors: ``{key: (mesh, placements)}``. ``from_module`` reads the specs off a
    module's DTensor parameters and buffers."""

    def __init__(self, specs: Mapping[str, PlacementSpec]) -> None:
        super().__init__({key: key for key in specs})
        self.specs = {key: (mesh, tuple(placements)) for key, (mesh, placements) in specs.items()}

    @classmethod
    def from_module(cls, module: nn.Module) -> Distribute:
        specs = {
            key: (value.device_mesh, value.placements)
            for key, value in module.state_dict(keep_vars=True).items()
            if is_dtensor(value)
        }
        return cls(specs)

    def _transform(self, key: str, tensor: Tensor) -> Tensor:
        mesh, placements = self.specs[key]
        return distribute_full(tensor, mesh, placements)

    def inverse(self) -> Gather:
        return Gather(self.specs)

    def __repr__(self) -> str:
        return f"Distribute({self._keys_repr()})"


class Gather(_KeyWise):
    """Turn DTensors into full tensors with ``full_tensor()`` (plain tensors pass through).

    Gathering is a collective: every rank must apply the same groups in the same order.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__({key: key for key in keys})

    def _transform(self, key: str, tensor: Tensor) -> Tensor:
        return full_tensor(tensor)

    def inverse(self) -> Distribute:
        raise NotInvertibleError(f"{self!r} has no inverse: a full tensor does not say how to distribute it")

    def __repr__(self) -> str:
        return f"Gather({self._keys_repr()})"
