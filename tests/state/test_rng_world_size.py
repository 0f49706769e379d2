"""Random-number states on resume when the world size changed (``state/rng.py``): a rank with a saved
counterpart gets its states back, a new rank a deterministic stream of its own; rank 0 logs the rule."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from lightning_d9d.state import rng


def draws() -> tuple[list[float], float, float]:
    """What a rank draws next from each generator the checkpoint carries."""
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def saved_ranks(count: int) -> tuple[list[dict[str, Any]], list[tuple]]:
    """``count`` ranks' states, seeded apart as ranks are, and what each would draw next."""
    states, expected = [], []
    for rank in range(count):
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        states.append(rng.collect())
        expected.append(draws())
    return states, expected


def resumed(states: list[dict[str, Any]], rank: int, world_size: int) -> tuple:
    torch.manual_seed(12345)  # whatever this run's own seeding left behind
    random.seed(12345)
    np.random.seed(12345)
    rng.restore_rank(states, rank, world_size)
    return draws()


def test_a_smaller_world_gives_each_remaining_rank_its_own_states(caplog: pytest.LogCaptureFixture) -> None:
    states, expected = saved_ranks(2)
    with caplog.at_level(logging.WARNING, logger=rng.__name__):
        assert resumed(states, 0, 1) == expected[0]  # dp 2 -> 1: rank 0 continues saved rank 0's streams
    assert "random-number states of 2 ranks, this run has 1" in caplog.text
    assert "streams of saved ranks 1 to 1 end" in caplog.text


def test_a_larger_world_seeds_each_new_rank_deterministically_and_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    states, expected = saved_ranks(2)
    with caplog.at_level(logging.WARNING, logger=rng.__name__):
        ranks = [resumed(states, rank, 4) for rank in range(4)]
    assert ranks[:2] == expected  # the ranks that existed get their own states back
    assert "ranks 2 to 3 are seeded from saved rank (rank % 2)'s state" in caplog.text
    # new ranks: reproducible, and no stream repeated (equal streams would draw equal dropout masks)
    assert [resumed(states, rank, 4) for rank in (2, 3)] == ranks[2:]
    assert len({tuple(r[0]) for r in ranks}) == 4
    assert len({r[1] for r in ranks}) == 4 and len({r[2] for r in ranks}) == 4
    # and they depend on the checkpoint, not only on the rank
    other_states, _ = saved_ranks(3)
    assert resumed(other_states[1:], 2, 4) != ranks[2]


def test_the_same_world_size_restores_every_rank_silently(caplog: pytest.LogCaptureFixture) -> None:
    states, expected = saved_ranks(2)
    with caplog.at_level(logging.WARNING, logger=rng.__name__):
        assert [resumed(states, rank, 2) for rank in range(2)] == expected
    assert caplog.text == ""
