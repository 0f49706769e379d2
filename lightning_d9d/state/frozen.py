"""Training checkpoints of runs whose base stays frozen (LoRA): the frozen parameters are left out, and a
fingerprint of them goes into ``meta.pt`` instead, so that a resume proves it continues on the same base.

A LoRA checkpoint then holds the adapters, their optimizer state and the loop's state: a small fraction of the
model, not the frozen base rewritten at every save. The base comes back from where it came from in the first place
(``LoadHFWeights`` loads it on resume too). The fingerprint is, per frozen parameter, the float64 sum of its
values and of their squares, computed on each rank's shard and summed over the mesh dims the shard is cut on: the
same numbers on any layout, up to float64 rounding, and nothing like them for another set of weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .errors import CheckpointError

FINGERPRINT_KEY = "frozen_base"
_CHUNK = 1 << 22  # elements summed at a time: a float64 copy of 32 MiB, never of a whole embedding


def canonical_param_name(name: str) -> str:
    """``name`` without the wrappers' name parts. Imported when called: the blocks pull in Lightning, which
    ``python -m lightning_d9d.convert`` does without (it never calls this)."""
    from lightning_d9d.modules.init import canonical_param_name as canonical

    return canonical(name)


def frozen_names(module: nn.Module) -> set[str]:
    """The state-dict names of ``module``'s frozen parameters (without the wrappers' name parts)."""
    return {canonical_param_name(name) for name, p in module.named_parameters() if not p.requires_grad}


def _local_sums(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK].double()
        sums[0] += part.sum()
        sums[1] += part.square().sum()
    return sums


def fingerprint(module: nn.Module) -> dict[str, tuple[float, float, int]]:
    """Per frozen parameter of ``module``: ``(sum, sum of squares, numel)``, every rank's parameters (a collective
    of the default group when there is one: every rank calls it)."""
    local: dict[str, tuple[torch.Tensor, int]] = {}
    by_group: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    meshes: dict[int, Any] = {}
    for name, param in sorted(module.named_parameters()):
        if param.requires_grad:
            continue
        key = canonical_param_name(name)
        if isinstance(param, DTensor):
            local[key] = (_local_sums(param.to_local()), param.numel())
            dims = tuple(i for i, p in enumerate(param.placements) if isinstance(p, Shard))
            meshes[id(param.device_mesh)] = param.device_mesh
            by_group.setdefault((id(param.device_mesh), dims), []).append(key)
        else:
            local[key] = (_local_sums(param), param.numel())
    for (mesh_id, dims), keys in by_group.items():  # one all-reduce per mesh dim a group of shards is cut on
        stacked = torch.stack([local[key][0] for key in keys])
        for dim in dims:
            dist.all_reduce(stacked, group=meshes[mesh_id].get_group(dim))
        for key, sums in zip(keys, stacked, strict=True):
            local[key] = (sums, local[key][1])
    mine = {key: (float(sums[0]), float(sums[1]), numel) for key, (sums, numel) in local.items()}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    every: list[dict[str, tuple[float, float, int]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # pipeline stages hold different parameters
    return {key: value for part in every for key, value in (part or {}).items()}


def _is_fingerprint(value: object) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 3
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    )


def check_same_base(
    saved: Mapping[str, Any], current: Mapping[str, tuple[float, float, int]], path: str
) -> None:
    """Refuse a resume whose model's frozen parameters are not the ones the checkpoint was trained on (names,
    sizes, and sums within float64 rounding of another summation order)."""
    if not isinstance(saved, Mapping) or not all(_is_fingerprint(value) for value in saved.values()):
        raise CheckpointError(
            f"{path}: meta.pt's {FINGERPRINT_KEY!r} is not a fingerprint of frozen parameters (name -> (sum, sum of "
            "squares, numel)): the file is damaged or crafted; choose another checkpoint"
        )
    missing = sorted(set(current) - set(saved))
    if missing:
        raise CheckpointError(
            f"{path} left out frozen parameters other than the model's ({missing[:3]} ... are frozen now and were "
            "trained then): resume with the same LoRA targets and frozen modules"
        )
    for key, (total, squares, numel) in current.items():
        saved_total, saved_squares, saved_numel = saved[key]
        # float64 sums of the same values in another order differ by far less than these bounds
        same = (
            numel == saved_numel
            and abs(squares - saved_squares) <= 1e-9 * max(squares, saved_squares, 1e-30)
            and abs(total - saved_total) <= 1e-9 * math.sqrt(numel * max(squares, saved_squares))
        )
        if not same:
            raise CheckpointError(
                f"{path} holds the trained parameters only, and the model's frozen {key} is not the one it was "
                f"trained on (sum {total:.6g} vs {saved_total:.6g}, sum of squares {squares:.6g} vs "
                f"{saved_squares:.6g}): load the base weights first — LoadHFWeights(<the base model's folder>) "
                "loads them on a Trainer's resume too; a Fabric loop loads them itself before fabric.load "
                "(lightning_d9d.state.hf.load_hf(model, <the folder>)) — and keep the base's dtype "
                "(LoRA(base_dtype=...)) as it was"
            )
