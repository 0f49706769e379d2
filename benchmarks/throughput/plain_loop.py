"""The plain training loop every non-Trainer path runs: the path's model (``build_model`` picks the ``paths_*``
builder by name), fp32 master weights with bf16 autocast (or FSDP2's MixedPrecisionPolicy for ``FSDP_LOOPS``),
fused AdamW, and the measured window: warm-up steps, timed steps with CUDA events, the host-sync probe, the
profiler."""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .instruments import (
    GpuStall,
    SyncProbe,
    _batches,
    _device,
    _Events,
    _ms,
    _profiler,
    _summary,
    _sync,
    _write_profile,
)
from .paths import FSDP_LOOPS, LORA_PATHS, TITAN_PATHS
from .paths_baseline import _hf_fsdp_compiled, hf_plain_loop_model
from .paths_lora import _peft_model, start_fingerprint
from .paths_ours import ours_plain_loop_model
from .paths_titan import _titan_loss, _titan_model
from .shapes import _config


def build_model(path: str, args: argparse.Namespace, device: Any) -> tuple[Any, Any]:
    """The module to train and the callable ``inputs -> logits``."""
    import torch

    config = _config(args)
    torch.manual_seed(args.seed)
    if path == "peft_fsdp_compiled":
        model = _peft_model(config, device, args.seed)
        return model, _hf_fsdp_compiled(model, device, model.get_base_model().model.layers)
    if path.startswith("hf"):
        return hf_plain_loop_model(path, config, device)
    if path in TITAN_PATHS:
        return _titan_model(args, config, device, path)
    return ours_plain_loop_model(path, args, config, device)


def run_plain_loop(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_d9d.modules.loss import causal_lm_loss

    device = _device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t_setup = time.perf_counter()
    model, forward = build_model(path, args, device)
    n_params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    inputs, labels = _batches(args, _config(args).vocab_size, device)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    # FSDP2's MixedPrecisionPolicy does the casting for FSDP_LOOPS; every other plain loop autocasts.
    autocast: AbstractContextManager[Any] = (
        nullcontext() if path in FSDP_LOOPS else torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    )
    _sync(device)
    setup_s = time.perf_counter() - t_setup
    # LoRA: what the loss guard's comparison rests on, that every path starts from the same weights
    start = start_fingerprint(model.named_parameters()) if path in LORA_PATHS else None
    events = _Events(device)
    stall = GpuStall(device, args.gpu_stall_ms)
    losses: list[Any] = []

    # torchtitan's trainer scores its model with its own compiled loss; every other path with ours.
    loss_fn = _titan_loss() if path in TITAN_PATHS else causal_lm_loss

    def step(marks: dict[str, Any] | None) -> None:
        i = len(losses)  # this step's batch
        if marks is not None:
            events.mark(marks, "start")
        stall()
        with autocast:
            loss = loss_fn(forward(inputs[i]), labels[i])
        if marks is not None:
            events.mark(marks, "forward")
        loss.backward()
        if marks is not None:
            events.mark(marks, "backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if marks is not None:
            events.mark(marks, "end")
        losses.append(loss.detach())

    warmup_times = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        step(None)
        _sync(device)
        warmup_times.append(time.perf_counter() - t)
    warmup_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # peak_mem_gib: the measured steps only
    steps: list[dict[str, Any]] = []
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        marks: dict[str, Any] = {}
        step(marks)
        steps.append(marks)
    _sync(device)
    elapsed = time.perf_counter() - t0
    probe = SyncProbe(device)
    probe.start()
    for _ in range(args.probe_steps):
        step(None)
    sync_probe = probe.stop()
    _sync(device)
    if args.profile_steps:  # after the probe's steps, as on the Trainer paths
        with _profiler(device) as profile:
            for _ in range(args.profile_steps):
                step(None)
            _sync(device)
        _write_profile(profile, args, path)

    result: dict[str, Any] = {
        "n_params": n_params,
        "trainable_params": sum(p.numel() for p in trainable),
        "setup_s": setup_s,
        "peak_mem_warmup_gib": warmup_peak,
        "first_step_s": warmup_times[0] if warmup_times else None,
        "warmup_s": sum(warmup_times),
        "elapsed_s": elapsed,
        "losses": [float(x) for x in losses],
        "sync_probe": sync_probe,
    }
    if start is not None:
        result["start"] = start
    if events.enabled and steps:
        result["step_ms"] = _summary([_ms(s["start"], s["end"]) for s in steps])
        result["forward_ms"] = _summary([_ms(s["start"], s["forward"]) for s in steps])
        result["backward_ms"] = _summary([_ms(s["forward"], s["backward"]) for s in steps])
        result["optimizer_ms"] = _summary([_ms(s["backward"], s["end"]) for s in steps])
        # Device idle between steps (host launch latency the GPU waited for).
        result["gap_ms"] = _summary([_ms(a["end"], b["start"]) for a, b in itertools.pairwise(steps)])
    if path == "ours_fsdp_loop" and device.type == "cuda" and args.time_adamw:
        result["adamw_ms"] = _time_adamw_variants(model, args)
    return result


def _time_adamw_variants(model: Any, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of one AdamW step over this model's parameters: foreach (the example's default) vs fused."""
    import torch

    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, kwargs in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
        times = []
        for i in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        out[name] = statistics.median(times)
        del opt
    return out
