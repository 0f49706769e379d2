"""``ExpertLoadBalancing``: the auxiliary-loss-free bias update after every optimizer step, and each MoE layer's
expert load (min / max / coefficient of variation) in the loggers.

Routers count the slots each expert received in every training forward (``TopKRouter.expert_load``), so after
an optimizer step the counters hold the whole accumulation window (and every pipeline microbatch). This
callback sums them over the ranks that routed different tokens through the same router replica (the d9d
strategy's ``routing`` view: data-parallel x context-parallel x tensor-parallel ranks, since each tp rank
routes its own positions; ep ranks included, never pp peers; the world under other strategies), moves each
selection bias by ``rate * sign(mean load - load)`` (:func:`~lightning_d9d.modules.moe.update_expert_bias`),
and resets the counters. Every rank applies the same
update, so the replicas stay equal.

An optimizer step is recognised by ``trainer.global_step`` moving, which also covers the short last window of an
epoch. Activation checkpointing (full or selective) does not change the counts: a router counts nothing while a
backward pass runs (:func:`lightning_d9d.compat.in_backward_pass`), so the recompute of a forward is not counted
again.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_d9d.modules.moe import LoadCountingRouter, counts_expert_load, update_expert_bias

_LAYER = re.compile(r"layers\.(\d+)\.")


class ExpertLoadBalancing(Callback):
    """After each optimizer step: update the routers' selection biases by ``bias_update_rate`` (routers built
    without a selection bias are only counted) and log per-layer load as ``moe/layer{i}/load_{min,max,cv}``
    (``log_load=False`` turns the logging off)."""

    def __init__(self, bias_update_rate: float = 1e-3, *, log_load: bool = True) -> None:
        if bias_update_rate < 0:
            raise ValueError(
                f"bias_update_rate ({bias_update_rate}) must be >= 0 (0 keeps the biases and only logs the load)"
            )
        self.bias_update_rate = bias_update_rate
        self.log_load = log_load
        self._last_step: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-step: keep counting
        self._last_step = trainer.global_step
        named = routers_by_layer(pl_module)
        if not named:
            return
        loads = update_expert_bias(list(named.values()), self.bias_update_rate, _data_group(trainer))
        if self.log_load:
            for name, stats in zip(named, layer_load_statistics(loads), strict=True):
                for stat, value in stats.items():
                    # the loads are already summed over the data ranks: every rank logs the same value
                    pl_module.log(f"moe/{name}/load_{stat}", value, on_step=True, on_epoch=False)


def routers_by_layer(module: torch.nn.Module) -> dict[str, LoadCountingRouter]:
    """The load-counting routers of ``module`` (ours, and a ``transformers`` MoE model's under the d9d strategy)
    keyed ``layer{i}`` by their decoder layer (their module path otherwise)."""
    named: dict[str, LoadCountingRouter] = {}
    for path, child in module.named_modules():
        if counts_expert_load(child):
            match = _LAYER.search(path + ".")
            named[f"layer{match.group(1)}" if match else path] = child
    return named


def load_statistics(load: torch.Tensor) -> dict[str, float]:
    """``min``, ``max`` and coefficient of variation (population std / mean; 0 for perfect balance) of one
    layer's per-expert load."""
    (stats,) = layer_load_statistics(load.unsqueeze(0))
    return stats


def layer_load_statistics(loads: torch.Tensor) -> list[dict[str, float]]:
    """:func:`load_statistics` of every row of ``loads [layers, experts]``, computed where the loads are and
    read back in one transfer: each read of a GPU value waits for the step's work queued so far, so three per
    layer would stall the host ~50 times per optimizer step on a 16-layer model instead of once."""
    as_float = loads.double()
    mean = as_float.mean(dim=1)
    cv = torch.where(mean > 0, as_float.std(dim=1, correction=0) / mean, torch.zeros_like(mean))
    table = torch.stack([as_float.amin(dim=1), as_float.amax(dim=1), cv], dim=1).tolist()
    return [{"min": low, "max": high, "cv": spread} for low, high, spread in table]


def _data_group(trainer: pl.Trainer) -> dist.ProcessGroup | None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is not None and dims.mesh is not None:
        group: dist.ProcessGroup = dims.mesh_for("routing").get_group()
        return group
    return dist.group.WORLD
