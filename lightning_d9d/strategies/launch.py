"""A check that runs in the launching process before Lightning's launcher starts the other processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_before_launch(launcher: Any, check: Callable[[], None]) -> None:
    """Make ``launcher.launch`` run ``check()`` first. Lightning calls ``launch`` from ``fit`` / ``validate`` /
    ... once the LightningModule is attached to the strategy, and starts the other processes inside it; an
    error from ``check`` then stops the run before any of them exists. The launcher object stays the same
    (Lightning tests its class, e.g. to kill the processes on Ctrl+C)."""
    launch = launcher.launch

    def checked_launch(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        check()
        return launch(function, *args, **kwargs)

    launcher.launch = checked_launch
