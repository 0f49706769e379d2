"""Every rank's random-number generators, saved in a training checkpoint and put back on resume.

Lightning does not checkpoint RNG states, so dropout masks or random augmentations after a resume would differ
from the uninterrupted run. Each rank's states (torch CPU, every CUDA device, Python's ``random``, NumPy's
global generator) travel in ``meta.pt`` as plain tensors, ints and tuples (what ``weights_only`` loading
accepts), one entry per rank. They are restored only on the same world size: on another layout a rank's
stream has no counterpart, and the states are left as they are (with a log line).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

log = logging.getLogger(__name__)

RNG_KEY = "d9d_rng_states_by_rank"  # in meta.pt


def collect() -> dict[str, Any]:
    """This rank's generator states."""
    import numpy as np

    kind, keys, position, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss_next),
        "numpy": (
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(position),
            int(has_gauss),
            float(gauss),
        ),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    """Put this rank's generators back to ``states`` (from :func:`collect`)."""
    import numpy as np

    torch.set_rng_state(states["torch"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(int(n) for n in internal.tolist()), gauss_next))
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def restore_rank(by_rank: list[dict[str, Any]] | None, rank: int, world_size: int) -> None:
    """Restore rank ``rank``'s entry of ``by_rank`` when the checkpoint came from ``world_size`` ranks."""
    if by_rank is None:
        return
    if len(by_rank) != world_size:
        if rank == 0:
            log.warning(
                "the checkpoint holds the random-number states of %d ranks, this run has %d: they are not "
                "restored (dropout and other random draws continue from this run's seeds)",
                len(by_rank),
                world_size,
            )
        return
    restore(by_rank[rank])
