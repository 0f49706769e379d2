"""Every rank's random-number generators, saved in a training checkpoint and put back on resume.

Lightning does not checkpoint RNG states, so dropout masks or random augmentations after a resume would differ
from the uninterrupted run. Each rank's states (torch CPU, every CUDA device, Python's ``random``, NumPy's
global generator) travel in ``meta.pt`` as plain tensors, ints and tuples (what ``weights_only`` loading
accepts), one entry per rank.

On the same world size every rank gets its own states back. On another world size (dp 2 -> 1, 1 -> 2, ...) the
rule is: rank r below the saved world size gets saved rank r's states back (on a shrink, the streams of the
ranks that are gone end); a rank r beyond it (on a growth) has no saved stream, so it is seeded from saved rank
``r % saved`` 's torch state and r (a hash of both): deterministic for a given checkpoint and layout, and
different from every other rank's stream. Rank 0 logs which rule applied. Draws after such a resume are not
those of the uninterrupted run (no layout change can give that), but they are reproducible.
"""

from __future__ import annotations

import hashlib
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


def derived_seed(states: dict[str, Any], rank: int) -> int:
    """A 63-bit seed from one saved rank's torch state and ``rank``: the same inputs give the same seed."""
    digest = hashlib.sha256(states["torch"].numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int) -> None:
    """Seed every generator :func:`collect` saves (torch CPU and CUDA, Python, NumPy) from ``seed``."""
    import numpy as np

    torch.manual_seed(seed)  # every CUDA device too
    random.seed(seed)
    np.random.seed(seed % 2**32)


def restore_rank(by_rank: list[dict[str, Any]] | None, rank: int, world_size: int) -> None:
    """Restore rank ``rank`` of ``world_size`` from ``by_rank`` (every saved rank's states, in rank order):
    its own entry when there is one, else seeded from entry ``rank % len(by_rank)`` and ``rank`` (module doc)."""
    if by_rank is None:
        return
    saved = len(by_rank)
    if saved != world_size and rank == 0:
        log.warning(
            "the checkpoint holds the random-number states of %d ranks, this run has %d: ranks below %d get "
            "their saved states back%s",
            saved,
            world_size,
            min(saved, world_size),
            f", ranks {saved} to {world_size - 1} are seeded from saved rank (rank % {saved})'s state and "
            "their rank"
            if world_size > saved
            else f" (the streams of saved ranks {world_size} to {saved - 1} end)",
        )
    if rank < saved:
        restore(by_rank[rank])
    else:
        reseed(derived_seed(by_rank[rank % saved], rank))
