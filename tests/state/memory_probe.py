"""Convert a checkpoint in a fresh process and report its peak RSS as JSON (run by ``test_state_memory.py``).

A process of its own, so that ``ru_maxrss`` sees nothing but the imports and the conversion: the baseline is
taken after the imports, the peak after converting.

Usage: ``python memory_probe.py``, then one JSON line on stdin: ``[source, destination, max_shard_bytes, layers,
experts, dense]``. Reading the arguments only after the imports lets the test write the checkpoint while this
process is still importing (``import lightning`` alone takes ~10 s on a CI machine).
"""

from __future__ import annotations

import json
import resource
import sys
import time

from lightning_d9d.state import (
    CheckpointReader,
    ModelStateMapper,
    Parallel,
    Rename,
    Stack,
    Transpose,
    convert,
)


def expert_key(layer: int, expert: int) -> str:
    return f"layers.{layer}.experts.{expert}.weight"


def dense_key(index: int) -> str:
    return f"dense.{index}.weight"


def memory_mapper(layers: int, experts: int, dense: int) -> ModelStateMapper:
    """Stack each layer's experts (the largest groups); rename or transpose the dense tensors."""
    stacks = [Stack([expert_key(i, e) for e in range(experts)], f"layers.{i}.experts") for i in range(layers)]
    renames = Rename({dense_key(j): f"renamed.{j}" for j in range(0, dense, 2)})
    transposes = Transpose([dense_key(j) for j in range(1, dense, 2)])
    return Parallel([*stacks, renames, transposes, Rename({"norm.weight": "final_norm.weight"})])


def _rss_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
    source, destination, max_shard_bytes, layers, experts, dense = json.loads(sys.stdin.readline())
    mapper = memory_mapper(layers, experts, dense)
    plan = CheckpointReader(source).plan(mapper)  # header reads only: part of the baseline, like the imports
    baseline_peak, baseline_now = _peak_rss(), _rss_now()
    start = time.perf_counter()
    convert(source, destination, mapper, max_shard_bytes=max_shard_bytes)
    seconds = time.perf_counter() - start
    report = {
        "baseline_peak": baseline_peak,
        "baseline_now": baseline_now,
        "peak": _peak_rss(),
        "seconds": seconds,
        "largest_group_bytes": plan.largest_group_bytes,
        "checkpoint_bytes": plan.total_bytes,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
