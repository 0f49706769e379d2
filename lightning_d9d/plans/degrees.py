"""Which parallel degrees a plan implements: one check, one error message, for the strategy and every plan."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from lightning_d9d.mesh import ParallelDims

# What each degree is called in an error message, in the order the degrees are checked.
FEATURES = {
    "pp": "pipeline parallelism",
    "dp_replicate": "replicated data parallelism",
    "dp_shard": "sharded data parallelism",
    "cp": "context parallelism",
    "tp": "tensor parallelism",
    "ep": "expert parallelism",
}
# What the data-parallel plan (FSDP / HSDP / replication) covers on its own.
DATA_PARALLEL = ("dp_replicate", "dp_shard")
# What lightning_d9d has plans for (tp and cp: for models whose plan splits them, Qwen3; ep: for models
# with MoE blocks, Qwen3-MoE, through plans/expert.py).
IMPLEMENTED = ("pp", *DATA_PARALLEL, "cp", "tp", "ep")


def require_degrees(
    dims: ParallelDims,
    *,
    supported: Collection[str],
    owner: str,
    alternatives: Mapping[str, str] | None = None,
) -> None:
    """Raise ``NotImplementedError`` for the first degree of ``dims`` above 1 that is not in ``supported``.

    The message names ``owner`` (who refuses), the degree and its value, and the fix: set the degree to 1, or
    ``alternatives[degree]`` where there is another way. ``dp_shard=-1`` (not resolved yet) is never refused.
    """
    unknown = set(supported) - FEATURES.keys()
    if unknown:
        raise ValueError(
            f"require_degrees: unknown degree names {sorted(unknown)}; choose from {list(FEATURES)}"
        )
    for degree, feature in FEATURES.items():
        value = getattr(dims, degree)
        if value > 1 and degree not in supported:
            alternative = (alternatives or {}).get(degree)
            fix = f"use {degree}=1" + (f", or {alternative}" if alternative else "")
            raise NotImplementedError(f"{owner}: {degree}={value} is not implemented yet ({feature}); {fix}")
