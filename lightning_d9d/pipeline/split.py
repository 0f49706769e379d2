"""Which layers each pipeline stage holds, and which stages each rank holds."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_stage_layers(
    num_layers: int,
    num_stages: int,
    *,
    embedding_weight: float = 1.0,
    head_weight: float = 1.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[list[int]]:
    """Split ``num_layers`` consecutive layers into ``num_stages`` stages of at least one layer each.

    Without ``layers_per_stage`` the split minimises the most expensive stage, where a layer costs 1, the
    first stage also pays ``embedding_weight`` and the last ``head_weight`` (in layers: for a large
    vocabulary the head costs a few layers). ``layers_per_stage`` gives the counts explicitly.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages ({num_stages}) must be positive")
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages (pp*stages_per_rank); "
            "lower pp or stages_per_rank"
        )
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layers_per_stage {counts} must have {num_stages} positive entries adding up to {num_layers}"
            )
    else:
        counts = _min_max_partition(num_layers, num_stages, embedding_weight, head_weight)
    stages, start = [], 0
    for count in counts:
        stages.append(list(range(start, start + count)))
        start += count
    return stages


def _min_max_partition(num_layers: int, num_stages: int, first_extra: float, last_extra: float) -> list[int]:
    """Dynamic programme over (stages, layers): the counts that minimise the largest stage cost."""

    def cost(stage: int, count: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return count + extra

    inf = float("inf")
    # best[s][n]: the smallest possible maximum cost when the first s+1 stages hold the first n layers
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    choice = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for n in range(1, num_layers + 1):
        best[0][n] = cost(0, n)
        choice[0][n] = n
    for s in range(1, num_stages):
        for n in range(s + 1, num_layers + 1):
            for count in range(1, n - s + 1):
                value = max(best[s - 1][n - count], cost(s, count))
                # ties go to the later stage taking fewer layers, so leftovers land early and evenly
                if value < best[s][n]:
                    best[s][n], choice[s][n] = value, count
    counts, n = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        counts.append(choice[s][n])
        n -= choice[s][n]
    return counts[::-1]


def stages_of_rank(pp_rank: int, pp: int, stages_per_rank: int, *, v_shape: bool) -> list[int]:
    """Global stage indices held by ``pp_rank``: loop placement (r, r+pp, ...) or V placement (r, 2pp-1-r)."""
    if v_shape:
        if stages_per_rank != 2:
            raise ValueError(f"V-shaped schedules need stages_per_rank=2, got {stages_per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def rank_of_stage(stage: int, pp: int, stages_per_rank: int, *, v_shape: bool) -> int:
    for rank in range(pp):
        if stage in stages_of_rank(rank, pp, stages_per_rank, v_shape=v_shape):
            return rank
    raise ValueError(f"stage {stage} is outside the {pp * stages_per_rank} stages")
