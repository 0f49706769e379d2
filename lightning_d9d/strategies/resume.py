"""Where a resumed run picks up: the batch a checkpoint is at, and the random streams at its next step.

**A checkpoint written after the loop ended.** When ``fit`` stops (``max_steps``, ``max_epochs``,
``max_time``, ``should_stop``), Lightning ends the epoch it was in: its loop state then records that epoch as
processed and completed, whether or not its last batch was drawn (3 of 8 batches, say), and the last batch as
completed. A checkpoint written from that state (``trainer.save_checkpoint`` after ``fit`` returns, or from
``on_train_end``) is resumed by Lightning as the start of the *next* epoch, where the loader's saved position
then skips that many batches of the new order: the rest of the interrupted epoch is never seen and as many
batches of the next one are lost; and one that stopped at an epoch's last batch resumed one batch into the
next epoch. :func:`resume_where_fit_stopped` rewrites that loop state to the one a checkpoint written at the
end of the same batch (``on_train_batch_end``, as ``ModelCheckpoint(every_n_train_steps=...)`` saves) has,
which Lightning resumes at the next batch: the rest of the epoch, or the next epoch after a last batch.

**Random streams.** The states in the checkpoint are put back when it is loaded, before the fit loop creates
its iterators, each of which draws a base seed from torch's global generator. :class:`PendingRandomState` keeps
them, and the resumed pass puts them back where the uninterrupted run drew next (``ResumableDataLoader``):
mid-epoch, once its first batch is drawn (the uninterrupted run created no iterator there); at an epoch
boundary, it creates the new epoch's iterator from them (the uninterrupted run drew that seed from these
states) and puts back the states of right after that draw once its first batch is drawn (Lightning's resume
creates the validation iterator in between). A loader of the user's with its own ``state_dict`` gets them back
at the strategy's first ``on_train_batch_start`` of a mid-epoch resume. The training step's draws then continue
the saved streams exactly.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from lightning_d9d.state import rng

_FIT_LOOP, _EPOCHS, _BATCHES = "fit_loop", "epoch_progress", "epoch_loop.batch_progress"
_EPOCH_LOOP_STATE = "epoch_loop.state_dict"


def resume_where_fit_stopped(checkpoint: MutableMapping[str, Any]) -> bool:
    """Rewrite ``checkpoint["loops"]`` in place where it was written after the fit loop ended, to the state of
    a checkpoint written at the end of the same batch (see the module docstring). Returns whether it changed
    anything; a second call changes nothing."""
    fit_loop = checkpoint.get("loops", {}).get(_FIT_LOOP)
    if not isinstance(fit_loop, MutableMapping) or _EPOCHS not in fit_loop or _BATCHES not in fit_loop:
        return False
    batches, epochs = fit_loop[_BATCHES], fit_loop[_EPOCHS]
    counts = [batches["total"], batches["current"]]
    if not all(c["ready"] == c["started"] == c["processed"] == c["completed"] > 0 for c in counts):
        return False  # written inside a batch (its end is not completed yet), or before the first one
    if not all(
        e["started"] == e["processed"] == e["completed"] >= 1 for e in (epochs["total"], epochs["current"])
    ):
        return False  # the epoch is still running: Lightning resumes inside it
    for progress in counts:
        progress["completed"] -= 1  # the batch processed, its end hooks not yet done
    for progress in (epochs["total"], epochs["current"]):
        progress["processed"] = progress["completed"] = (
            progress["started"] - 1
        )  # the epoch started, not ended
    stepped = fit_loop.get(_EPOCH_LOOP_STATE, {})
    if "_batches_that_stepped" in stepped:  # counted once the batch ends, so not yet at its end hooks
        stepped["_batches_that_stepped"] -= 1
    if "epoch" in checkpoint:
        checkpoint["epoch"] = epochs["current"]["completed"]
    return True


class PendingRandomState:
    """This rank's generator states as a checkpoint load left them, put back once when the resumed run's
    first training batch is drawn mid-epoch (see the module docstring)."""

    def __init__(self) -> None:
        self._states: dict[str, Any] | None = None

    def capture(self) -> None:
        """Called right after a checkpoint put the states back: remember them."""
        self._states = rng.collect()

    def discard(self) -> None:
        self._states = None

    def restore(self, *, keep: bool = False) -> None:
        """Put the remembered states back (and forget them, unless ``keep``)."""
        if self._states is not None:
            rng.restore(self._states)
            if not keep:
                self._states = None
