"""What a path's worker measures with, whichever loop it runs: the device, every step's batch (the loss guard's
Zipf-like tokens), CUDA events without host syncs, the host-bound probe (``--gpu-stall-ms``), the host-sync probe
(``--probe-steps``), the profiler (``--profile-steps``) and the per-step summaries."""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from .paths import LORA_PATHS
from .paths_lora import LORA_RANK
from .shapes import _config


def _device(args: argparse.Namespace) -> Any:
    import torch

    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(args: argparse.Namespace, vocab: int, device: Any) -> tuple[Any, Any]:
    """Every step's batch: ``inputs [S, B, T]`` and next-token ``labels [S, B, T]`` for S = all steps run.

    Tokens are drawn independently from one fixed Zipf-like distribution over the vocabulary (weight
    ``1 / (rank + 10)``, ranks a seeded permutation), a fresh batch each step. A model learns that
    distribution smoothly (from ln(vocab) towards its entropy), so runs whose numerics differ only by bf16
    rounding end within a fraction of a percent of each other, while a run that does not train stays near
    ln(vocab). One fixed batch repeated (this benchmark's earlier data) is memorised chaotically: paths with
    identical numerics ended 2-3.5 % apart after 25 steps on the H200, and the guard could not tell noise
    from a defect.
    """
    import torch

    generator = torch.Generator().manual_seed(1234)
    ranks = torch.randperm(vocab, generator=generator)
    weights = torch.empty(vocab)
    weights[ranks] = 1.0 / (torch.arange(vocab, dtype=torch.float32) + 10.0)
    steps = args.warmup + args.steps + args.probe_steps + args.profile_steps
    ids = torch.multinomial(weights, steps * args.batch_size * (args.seq_len + 1), True, generator=generator)
    ids = ids.view(steps, args.batch_size, args.seq_len + 1)
    return ids[..., :-1].contiguous().to(device), ids[..., 1:].contiguous().to(device)


class _Events:
    """CUDA events recorded without host syncs; read once the window has been synchronised."""

    def __init__(self, device: Any) -> None:
        self.enabled = device.type == "cuda"
        self.marks: list[dict[str, Any]] = []

    def mark(self, step: dict[str, Any], name: str) -> None:
        import torch

        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            step[name] = event


def _ms(a: Any, b: Any) -> float:
    return float(a.elapsed_time(b))


class GpuStall:
    """``--gpu-stall-ms``: a spin kernel of that many GPU milliseconds queued at the start of every step.

    The host-bound probe: where the host runs ahead of the GPU (launches queued before the GPU needs them) a
    step grows by the whole stall; where the GPU waits for the host, the stall fills that wait first, so the
    step grows by less. ``stall - growth`` of the median step is the GPU's idle time per step (up to the stall).
    """

    def __init__(self, device: Any, ms: float) -> None:
        import torch

        self.cycles = 0
        if ms <= 0 or device.type != "cuda":
            return
        calibration = 20_000_000
        torch.cuda._sleep(calibration)  # first launch outside the timing
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(calibration)
        stop.record()
        torch.cuda.synchronize(device)
        self.cycles = int(calibration * ms / start.elapsed_time(stop))

    def __call__(self) -> None:
        import torch

        if self.cycles:
            torch.cuda._sleep(self.cycles)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


class SyncProbe:
    """Counts host<->device synchronisations (``torch.cuda.set_sync_debug_mode("warn")``) over a few extra
    steps after the measured window, and where in the Python code they were issued.

    Syncs inside calls that release the GIL without a Python warning handler (``torch.distributed`` ops, such
    as the NCCL ``barrier``) are printed by C++ instead; the parent counts those lines between the markers
    this probe prints (``native_syncs``).
    """

    START, END = "SYNC-PROBE-START", "SYNC-PROBE-END"

    def __init__(self, device: Any) -> None:
        self.enabled = device.type == "cuda"
        self.records: list[Any] = []
        self._catcher: Any = None
        self._markers = False
        # The first switch of the debug mode reports one sync of its own: spend it here.
        self.start()
        self.stop()
        self._markers = True

    def start(self) -> None:
        import warnings

        import torch

        if not self.enabled or self._catcher is not None:
            return
        self._catcher = warnings.catch_warnings(record=True)
        self.records = self._catcher.__enter__()
        warnings.simplefilter("always")
        if self._markers:
            sys.stderr.flush()
            print(self.START, flush=True)
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> dict[str, Any] | None:
        import torch

        if not self.enabled or self._catcher is None:
            return None
        torch.cuda.set_sync_debug_mode("default")
        if self._markers:
            sys.stderr.flush()
            print(self.END, flush=True)
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        syncs = [w for w in self.records if "synchroniz" in str(w.message)]
        where: dict[str, int] = {}
        for w in syncs:
            key = f"{w.filename}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
        return {"syncs": len(syncs), "where": where}


def _profiler(device: Any) -> Any:
    """``--profile-steps``' profiler: the host's ops with their operands' shapes (which GEMMs are the adapters'),
    and the device's kernels."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


def _write_profile(profile: Any, args: argparse.Namespace, path: str) -> None:
    """``--profile-steps``: where the step goes by kind of kernel (GEMMs of the blocks, the adapters and the LM
    head, attention, the loss, element-wise, the optimizer: ``profile_step.step_breakdown``), where the GPU waited,
    and the kernel table, as ``profile_<path>.txt`` in ``--out``."""
    from gpu_gaps import profile_report
    from profile_step import step_breakdown

    rank = LORA_RANK if path in LORA_PATHS else None
    try:  # a diagnostic: the path's measurement stands without it
        kinds = step_breakdown(profile, args.profile_steps, rank=rank, vocab=_config(args).vocab_size)
    except Exception as error:
        kinds = f"kernel kinds not available: {type(error).__name__}: {error}\n"
    text = f"{path}, {args.profile_steps} profiled steps\n\n{kinds}\n" + profile_report(
        profile, args.profile_steps, rows=40
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{path}.txt").write_text(text)
    print(text, flush=True)
