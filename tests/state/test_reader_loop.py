"""Both checkpoint readers stream through one loop: the same checks on what a mapper returns."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from state_helpers import write_checkpoint
from torch import Tensor

from lightning_d9d.state import CheckpointReader, DCPReader, Group, Identity, MapperError, ModelStateMapper
from lightning_d9d.state.stream import MappedReader

STATE = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4)}


class Misreporting(ModelStateMapper):
    """Declares that each key maps to itself, but returns it under another name."""

    def groups(self) -> Sequence[Group]:
        return [Group((key,), (key,)) for key in sorted(STATE)]

    def apply(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {f"{key}.renamed": value for key, value in inputs.items()}


def safetensors_reader(directory: Path) -> MappedReader:
    write_checkpoint(directory, STATE, files=1)
    return CheckpointReader(directory)


def dcp_reader(directory: Path) -> MappedReader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP announces that it runs without a process group
        dcp.save({"state_dict": dict(STATE)}, checkpoint_id=str(directory), no_dist=True)
    return DCPReader(directory)


@pytest.mark.parametrize("make_reader", [safetensors_reader, dcp_reader], ids=["safetensors", "dcp"])
def test_a_mapper_returning_other_keys_than_its_group_declares_is_named(
    make_reader: Callable[[Path], MappedReader], tmp_path: Path
) -> None:
    reader = make_reader(tmp_path / "ckpt")
    results = reader.stream(Misreporting())
    with pytest.raises(
        MapperError, match=r"returned 'a.weight.renamed' for a group that declares 'a.weight'"
    ):
        next(results)


@pytest.mark.parametrize("make_reader", [safetensors_reader, dcp_reader], ids=["safetensors", "dcp"])
def test_both_readers_stream_every_group_in_storage_order(
    make_reader: Callable[[Path], MappedReader], tmp_path: Path
) -> None:
    reader = make_reader(tmp_path / "ckpt")
    results = list(reader.stream(Identity(STATE)))
    assert [result.group.inputs for result in results] == [("a.weight",), ("b.weight",)]
    for result in results:
        (key,) = result.group.inputs
        assert torch.equal(result.outputs[key], STATE[key])
        assert key in result.origin()
