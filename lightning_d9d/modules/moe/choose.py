"""Which expert-parallel dispatcher a model gets: all-to-all (the default, runs on gloo and NCCL) or DeepEP.

Chosen by ``backend=`` or the environment variable ``LIGHTNING_D9D_MOE_DISPATCH`` (``all_to_all`` or
``deepep``). DeepEP asked for but not installed falls back to all-to-all with one warning line: an optional
package is never an error.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from lightning_d9d.modules.moe.all_to_all import AllToAllDispatcher
from lightning_d9d.modules.moe.deepep import DeepEPDispatcher, deep_ep_available, new_deep_ep_buffer
from lightning_d9d.modules.moe.dispatch import TokenDispatcher

log = logging.getLogger("lightning_d9d.moe")

ENV_VAR = "LIGHTNING_D9D_MOE_DISPATCH"
BACKENDS = ("all_to_all", "deepep")


def expert_parallel_dispatcher(
    group: dist.ProcessGroup, num_experts: int, backend: str | None = None
) -> TokenDispatcher:
    """A dispatcher over the ``ep`` process group ``group`` for ``num_experts`` experts split evenly on it."""
    chosen = backend or os.environ.get(ENV_VAR) or "all_to_all"
    if chosen not in BACKENDS:
        raise ValueError(
            f"unknown MoE dispatch backend {chosen!r} (from {'backend=' if backend else ENV_VAR}); "
            f"choose one of {', '.join(BACKENDS)}"
        )
    if chosen == "deepep":
        if deep_ep_available():
            log.info("MoE dispatch: DeepEP over %d ranks", dist.get_world_size(group))
            return DeepEPDispatcher(new_deep_ep_buffer(group), num_experts)
        log.warning("MoE dispatch: deep_ep is not installed; falling back to all_to_all")
    return AllToAllDispatcher(group, num_experts)
