"""Guards of a run: ``NonFiniteGuard`` (a non-finite loss or gradient stops training with a report, or the step
is skipped) and the check of the collective timeout.

Every optimizer step, each rank takes the norm of its local gradients (one foreach kernel per dtype and
device; a NaN or inf anywhere makes it non-finite) and whether its loss was finite; one all-reduce of two
numbers over all ranks makes every rank decide the same (a rank alone skipping its update would leave
replicas apart, one rank alone raising would leave the others hanging). That costs one host sync per step.

Only when something is non-finite is more work done: every rank names its parameters whose gradients are not
finite, in the module's order, and the report gives the step, the ranks whose loss was not finite, and the
first and last parameter per rank (backward runs in reverse module order, so the last one listed is usually
where the non-finite values appeared first).

``action="raise"`` raises :class:`NonFiniteError` on every rank; ``action="skip"`` drops the step's gradients
(the optimizer then leaves every parameter and its state as they were; the LR scheduler still steps) and warns.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_d9d.mesh.arrival import named_collective

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

ACTIONS = ("raise", "skip")


def check_collective_timeout(timeout: object) -> None:
    """``D9DStrategy(timeout=...)`` must be a positive ``timedelta`` (or None for torch's default): checked in
    the constructor, before any process starts, rather than inside ``init_process_group`` on every rank."""
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"D9DStrategy(timeout={timeout!r}): give a datetime.timedelta, for example timedelta(minutes=10)"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"D9DStrategy(timeout={timeout!r}): the collective timeout must be positive")


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN or infinite (raised on every rank, with the same report)."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grads(module: nn.Module) -> list[Tensor]:
    return [_local(p.grad) for p in module.parameters() if p.grad is not None]


def nonfinite_parameters(module: nn.Module) -> list[str]:
    """This rank's parameters whose (local part of the) gradient holds a NaN or inf, in module order."""
    return [
        name
        for name, p in module.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
    ]


def check_step(module: nn.Module, loss_finite: bool | Tensor, step: int) -> str | None:
    """Collective over the default group (if any): None when every rank's loss and gradients are finite, else
    the same report on every rank."""
    grads = _grads(module)
    device = grads[0].device if grads else torch.device("cpu")
    norm = (
        torch.nn.utils.get_total_norm(grads).float().to(device) if grads else torch.zeros((), device=device)
    )
    # [nonfinite gradients, nonfinite losses]: sums over ranks (a NaN norm becomes a count of 1)
    loss_flag = torch.as_tensor(loss_finite, device=device)
    flags = torch.stack([(~torch.isfinite(norm)).float(), (~loss_flag).float()])
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        with named_collective("the non-finite guard's all_reduce"):
            dist.all_reduce(flags)
    if not bool(flags.sum() > 0):
        return None
    mine = (bool(loss_finite), nonfinite_parameters(module))
    outcomes: list[Any] = [mine]
    if distributed:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
    losses = [rank for rank, (finite, _) in enumerate(outcomes) if not finite]
    parts = [f"global step {step}:"]
    if losses:
        parts.append(f"the loss is not finite on ranks {losses};")
    for rank, (_, names) in enumerate(outcomes):
        if names:
            parts.append(
                f"rank {rank}: {len(names)} parameters with non-finite gradients, first {names[0]!r}, last "
                f"{names[-1]!r} (backward reaches the last one first);"
            )
    return " ".join(parts)


class NonFiniteGuard(Callback):
    """Check every optimizer step for a non-finite loss or gradient; ``action``: ``"raise"`` or ``"skip"``.

    ``skipped`` lists the global steps that were skipped.
    """

    def __init__(self, action: str = "raise") -> None:
        if action not in ACTIONS:
            raise ValueError(f"NonFiniteGuard(action={action!r}): choose one of {', '.join(ACTIONS)}")
        self.action = action
        self.skipped: list[int] = []
        self._loss_finite: bool | Tensor = True

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # with gradient accumulation the step is bad if any of its micro-batches was; kept on the device (no
        # host sync per micro-batch): the step's one all-reduce carries it
        self._loss_finite = torch.isfinite(loss.detach()).all() & torch.as_tensor(self._loss_finite)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        loss_finite, self._loss_finite = self._loss_finite, True
        report = check_step(pl_module, loss_finite, trainer.global_step)
        if report is None:
            return
        if self.action == "raise":
            raise NonFiniteError(
                f"non-finite values at {report} (NonFiniteGuard(action='skip') skips such steps)"
            )
        optimizer.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves parameters and state alone
        self.skipped.append(trainer.global_step)
        rank_zero_warn(f"NonFiniteGuard skipped the optimizer step at {report}")
