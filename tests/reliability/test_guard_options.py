"""Options of the guards refused with a clear error in the constructor, before any process starts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_d9d import D9DStrategy
from lightning_d9d.strategies import NonFiniteGuard


def test_the_collective_timeout_must_be_a_positive_timedelta() -> None:
    assert D9DStrategy(timeout=timedelta(seconds=90))._timeout == timedelta(seconds=90)
    with pytest.raises(TypeError, match=r"timeout=30\): give a datetime.timedelta"):
        D9DStrategy(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be positive"):
        D9DStrategy(timeout=timedelta(0))


def test_the_guard_action_must_be_raise_or_skip() -> None:
    with pytest.raises(ValueError, match=r"action='ignore'\): choose one of raise, skip"):
        NonFiniteGuard("ignore")
