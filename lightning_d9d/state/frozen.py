"""Training checkpoints of runs whose base stays frozen (LoRA): the frozen parameters are left out, and a
fingerprint of them goes into ``meta.pt`` instead, so that a resume proves it continues on the same base.

A LoRA checkpoint then holds the adapters, their optimizer state and the loop's state: a small fraction of the
model, not the frozen base rewritten at every save. The base comes back from where it came from in the first place
(``LoadHFWeights`` loads it on resume too). The fingerprint is, per frozen parameter, the float64 sum of its
values and of their squares, computed on each rank's shard and summed over the mesh dims the shard is cut on: the
same numbers on any layout, up to float64 rounding, and nothing like them for another set of weights.

Beside it ``meta.pt`` records the LoRA settings the run trained with (:func:`lora_record`, plain values only), so
that ``python -m lightning_d9d.convert dcp-to-hf --base <folder>`` can merge the adapters into that base later
without the run's code: rank, alpha, dropout, targets, experts, base_dtype, each frozen parameter's dtype and each
adapted stacked-experts weight's layout. :func:`read_lora_record` reads it back from an untrusted file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .errors import CheckpointError

FINGERPRINT_KEY = "frozen_base"
LORA_KEY = "lora"  # in meta.pt: the LoRA settings (lora_record)
# the dtypes a frozen base is kept in, by the names a record gives them
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
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
    return _every_rank({key: (float(sums[0]), float(sums[1]), numel) for key, (sums, numel) in local.items()})


def _every_rank(mine: dict[str, Any]) -> dict[str, Any]:
    """``mine`` merged with every other rank's (pipeline stages hold different parameters): a collective of the
    default group when there is one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    every: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {key: value for part in every for key, value in (part or {}).items()}


def tensor_sums(tensor: torch.Tensor) -> tuple[float, float, int]:
    """One whole tensor's entry of a fingerprint: ``(sum, sum of squares, numel)`` in float64."""
    sums = _local_sums(tensor)
    return float(sums[0]), float(sums[1]), tensor.numel()


def same_sums(current: tuple[float, float, int], saved: tuple[float, float, int]) -> bool:
    """Whether two fingerprint entries are of the same values: the same size, and sums within float64 rounding
    of another summation order (far less than these bounds)."""
    (total, squares, numel), (saved_total, saved_squares, saved_numel) = current, saved
    return (
        numel == saved_numel
        and abs(squares - saved_squares) <= 1e-9 * max(squares, saved_squares, 1e-30)
        and abs(total - saved_total) <= 1e-9 * math.sqrt(numel * max(squares, saved_squares))
    )


def is_fingerprint(value: object) -> bool:
    """Whether ``value`` (read from an untrusted ``meta.pt``) has a fingerprint's form."""
    return isinstance(value, Mapping) and all(
        isinstance(key, str) and _is_fingerprint(entry) for key, entry in value.items()
    )


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
    if not is_fingerprint(saved):
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
        saved_total, saved_squares, _ = saved[key]
        if not same_sums((total, squares, numel), saved[key]):
            raise CheckpointError(
                f"{path} holds the trained parameters only, and the model's frozen {key} is not the one it was "
                f"trained on (sum {total:.6g} vs {saved_total:.6g}, sum of squares {squares:.6g} vs "
                f"{saved_squares:.6g}): load the base weights first — LoadHFWeights(<the base model's folder>) "
                "loads them on a Trainer's resume too; a Fabric loop loads them itself before fabric.load "
                "(lightning_d9d.state.hf.load_hf(model, <the folder>)) — and keep the base's dtype "
                "(LoRA(base_dtype=...)) as it was"
            )


# ------------------------------------------------------------------------------------------- LoRA settings
@dataclass(frozen=True)
class LoRARecord:
    """The LoRA settings a checkpoint records (:func:`lora_record`), read back (:func:`read_lora_record`).
    ``frozen_dtypes``: each frozen parameter's dtype; ``expert_layouts``: each adapted stacked-experts weight
    (``<experts>.<weight>``, in the experts module's parameter order) and whether it holds ``[E, out, in]``."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    experts: bool
    base_dtype: torch.dtype | None
    frozen_dtypes: dict[str, torch.dtype]
    expert_layouts: dict[str, bool]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_record(config: Any, module: nn.Module) -> dict[str, Any]:
    """The settings of ``config`` (a :class:`~lightning_d9d.plans.lora.LoRA`) and of ``module``'s adapters as
    plain values, every rank's (a collective of the default group when there is one)."""
    from .hf.peft import expert_adapters  # the adapters' blocks, found without importing them

    local: dict[str, Any] = {
        f"dtype:{canonical_param_name(name)}": _dtype_name(param.dtype)
        for name, param in module.named_parameters()
        if not param.requires_grad
    }
    for experts, adapter in expert_adapters(module).items():
        for weight, layout in adapter.weights.items():
            local[f"layout:{canonical_param_name(experts)}.{weight}"] = bool(layout.out_first)
    merged = _every_rank(local)
    return {
        "rank": int(config.rank),
        "alpha": float(config.alpha),
        "dropout": float(config.dropout),
        "targets": [str(target) for target in config.targets],
        "experts": bool(config.experts),
        "base_dtype": None if config.base_dtype is None else _dtype_name(config.base_dtype),
        "frozen_dtypes": {key[6:]: value for key, value in merged.items() if key.startswith("dtype:")},
        "expert_layouts": {key[7:]: value for key, value in merged.items() if key.startswith("layout:")},
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_lora_record(meta: Mapping[str, Any], path: str) -> LoRARecord | None:
    """The LoRA settings ``meta`` (an untrusted ``meta.pt``'s content) records, checked field by field; ``None``
    when it records none. Raises ``CheckpointError`` naming the field that is not what :func:`lora_record`
    writes."""
    record = meta.get(LORA_KEY)
    if record is None:
        return None

    def refuse(field: str, value: object, what: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: meta.pt's {LORA_KEY!r} {field} is {value!r}, not {what}: the file is damaged or crafted; "
            "choose another checkpoint"
        )

    if not isinstance(record, Mapping):
        raise refuse("record", type(record).__name__, "a mapping of the LoRA settings")
    rank, alpha, dropout = record.get("rank"), record.get("alpha"), record.get("dropout")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("rank", rank, "a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse("alpha", alpha, "a finite number")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
        raise refuse("dropout", dropout, "a number in [0, 1)")
    targets = record.get("targets")
    if not isinstance(targets, list) or not all(isinstance(target, str) for target in targets):
        raise refuse("targets", targets, "a list of module-name patterns")
    experts = record.get("experts")
    if not isinstance(experts, bool):
        raise refuse("experts", experts, "True or False")
    base_dtype = record.get("base_dtype")
    if base_dtype is not None and base_dtype not in _DTYPES:
        raise refuse("base_dtype", base_dtype, f"None or one of {sorted(_DTYPES)}")
    dtypes, layouts = record.get("frozen_dtypes"), record.get("expert_layouts")
    if not isinstance(dtypes, Mapping) or not all(
        isinstance(key, str) and value in _DTYPES for key, value in dtypes.items()
    ):
        raise refuse("frozen_dtypes", type(dtypes).__name__, f"a mapping of names to {sorted(_DTYPES)}")
    if not isinstance(layouts, Mapping) or not all(
        isinstance(key, str) and isinstance(value, bool) for key, value in layouts.items()
    ):
        raise refuse("expert_layouts", type(layouts).__name__, "a mapping of names to True or False")
    return LoRARecord(
        rank=rank,
        alpha=float(alpha),
        dropout=float(dropout),
        targets=tuple(targets),
        experts=experts,
        base_dtype=None if base_dtype is None else _DTYPES[base_dtype],
        frozen_dtypes={key: _DTYPES[value] for key, value in dtypes.items()},
        expert_layouts=dict(layouts),
    )
