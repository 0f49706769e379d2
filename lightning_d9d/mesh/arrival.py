"""Name the ranks that never reached a collective when it fails, instead of the backend's bare error.

A collective whose peer hangs waits for the process group's timeout (``D9DStrategy(timeout=...)``); then gloo
says only ``Timed out waiting 3000ms for recv operation to complete``, and NCCL's watchdog names the
collective's sequence number; neither names the rank that is missing. Around our own collectives at known
points (the ranks' agreement on a checkpoint, the non-finite guard, the pipeline's same-batch check)
:func:`named_collective` has every rank
mark its arrival in the default group's key-value store first; if the collective then fails (a timeout, or a
peer's connection gone), the marks tell which ranks never came, and the error names them and the collective
(``CollectiveError: the non-finite guard's all_reduce over the 2 ranks of the default group failed: rank 1
did not arrive ...``). A rank that died still fails the others as soon as the backend notices, not after the
timeout. The cost is one store write per call, and one delete.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

# How many times this process entered each named collective: every rank enters them in the same order, so
# the n-th arrival of rank r has the same key on every rank.
_rounds: dict[str, int] = {}


class CollectiveError(RuntimeError):
    """A collective failed; ``missing`` lists the ranks that never arrived at it (empty: all did)."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def _key(collective: str, round_: int, rank: int) -> str:
    return f"d9d/arrival/{collective}/{round_}/{rank}"


@contextmanager
def named_collective(collective: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the body (one collective over ``group``, default: the default group, entered by each of its ranks
    in the same order); if it raises, raise :class:`CollectiveError` naming ``collective`` and the (global)
    ranks that did not arrive at it. Without a process group, or with one rank, the body runs as it is."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        yield
        return
    from lightning_d9d.compat import default_store  # here: compat imports Lightning (see parallel_dims)

    store, rank = default_store(), dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    where = "the default group" if group is None else f"the group of ranks {ranks}"
    # groups of the same kind (one pipeline per dp replica) run the same collective: keep their marks apart
    collective_key = collective if group is None else f"{collective}/{'-'.join(map(str, ranks))}"
    round_ = _rounds.get(collective_key, 0)
    _rounds[collective_key] = round_ + 1
    try:
        store.set(_key(collective_key, round_, rank), "1")
        if round_:  # every rank has left the previous round's collective: nobody reads that mark any more
            store.delete_key(_key(collective_key, round_ - 1, rank))
    except Exception:  # the store lives with rank 0: if it is gone, the collective fails and says so below
        pass
    try:
        yield
    except Exception as error:
        try:
            missing = [r for r in ranks if not store.check([_key(collective_key, round_, r)])]
            who = (
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive "
                f"(it hangs or died: see its log)"
                if missing
                else "every rank arrived, so one died or hung inside it"
            )
        except Exception:
            missing, who = [0], "the store on rank 0 is unreachable, so rank 0 died"  # it hosts the store
        raise CollectiveError(
            f"{collective} over the {len(ranks)} ranks of {where} failed on rank {rank}: {who}; the "
            f"timeout is D9DStrategy(timeout=...). {type(error).__name__}: {error}",
            missing,
        ) from error
