"""Async tensor parallelism: torch's micro-pipelined TP (``D9DStrategy(async_tp=True)``).

Under tp the blocks all-gather the sequence shards before their column-parallel projections and reduce-scatter
after their row-parallel ones (:mod:`lightning_d9d.plans.tensor`). Inductor's ``_micro_pipeline_tp`` pass finds
each all-gather -> matmul and matmul -> reduce-scatter pair in a compiled block and replaces it with torch's fused
``symm_mem`` operators, which cut the matmul into chunks and overlap each chunk's communication with the next
chunk's compute through CUDA symmetric memory, as torchtitan's ``enable_async_tp`` does. So it needs the blocks
compiled (the pass runs inside Inductor), tp > 1 (nothing to overlap otherwise) and CUDA with NCCL (symmetric
memory exists nowhere else); each is refused by name before any process group exists.

:func:`enable_async_tp` sets Inductor's flag for the process (it is a module-level config; the compiled blocks
read it when they compile, after the strategy sets up) and registers the tp group with symmetric memory.
"""

from __future__ import annotations

from lightning_d9d.compat import enable_micro_pipeline_tp


def check_async_tp(enabled: bool, *, tp: int, compile: bool | str, owner: str) -> bool:
    """Refuse async TP where it cannot apply (tp = 1, compile off); returns ``enabled``."""
    if not enabled:
        return False
    if tp <= 1:
        raise ValueError(
            f"{owner}: async_tp=True overlaps tensor-parallel collectives with matmuls, but tp={tp}: use tp > 1, or "
            "async_tp=False"
        )
    if compile is False:
        raise ValueError(
            f"{owner}: async_tp=True is an Inductor pass (torch's micro-pipelined TP) and needs the blocks "
            "compiled: compile=True (or a compile mode), or async_tp=False"
        )
    return True


def check_async_tp_device(enabled: bool, device_type: str, *, owner: str) -> None:
    """Refuse async TP off CUDA: torch's symmetric memory, which its fused operators need, is CUDA (NCCL) only."""
    if enabled and device_type != "cuda":
        raise ValueError(
            f"{owner}: async_tp=True needs CUDA GPUs (torch's symmetric memory is CUDA / NCCL only), but the "
            f"accelerator is {device_type!r}: use accelerator='gpu', or async_tp=False"
        )


def enable_async_tp(tp_group_name: str) -> None:
    """Turn on Inductor's micro-pipelined TP pass and register the tp group (by its process-group name) with
    symmetric memory. Call once the mesh exists and before the first block compiles. Both are private torch
    names, reached through :mod:`lightning_d9d.compat`."""
    enable_micro_pipeline_tp(tp_group_name)
