"""``Throughput``: tokens/s, TFLOP/s, MFU, step time and peak memory, on the progress bar and in the loggers.

Nothing is read back from the device between window boundaries: on CUDA a window's span is measured with two
``torch.cuda.Event(enable_timing=True)`` (the end one is waited for once, when the window closes), on CPU with
``time.perf_counter``. Token counts come from the batches' shapes (host-side), never from their values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

# Dense bf16 tensor-core peaks (no 2:4 sparsity) in FLOP/s, per GPU, from NVIDIA's data sheets. The first key
# found in the lower-cased device name wins, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("h200 nvl", 835e12),
    ("h200", 989.4e12),  # SXM
    ("a100", 312e12),
    ("b200", 2250e12),
)

TokenCounter = Callable[[Any], tuple[int, int]]
"""``batch -> (tokens, sequence length)`` of one rank's batch, from shapes only."""


def peak_flops_of(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s from :data:`PEAK_BF16_FLOPS`; None for a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def count_input_tokens(batch: Any) -> tuple[int, int]:
    """Tokens of a batch of token ids: ``batch["input_ids"]`` for a mapping, else the first tensor found in it
    (a tensor, or a tuple / list holding one). Every position counts, padding too: counting only the real
    tokens would read the batch's values, a host synchronisation on every step."""
    tensor = _first_tensor(
        batch["input_ids"] if isinstance(batch, Mapping) and "input_ids" in batch else batch
    )
    if tensor is None or tensor.dim() == 0:
        raise ValueError(
            f"Throughput: no tensor of token ids in the batch ({type(batch).__name__}); pass "
            "Throughput(count_tokens=lambda batch: (tokens, seq_len))"
        )
    return tensor.numel(), int(tensor.shape[-1])


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, Sequence) else ()
    for item in items:
        if not isinstance(item, str) and (found := _first_tensor(item)) is not None:
            return found
    return None


def find_flops_model(pl_module: pl.LightningModule, module_attr: str | None = None) -> nn.Module | None:
    """The module with ``num_flops_per_token(seq_len)``: ``module_attr`` (``""`` for the LightningModule), else
    the LightningModule itself or its only direct child that has one; None when there is none."""
    if module_attr is not None:
        module = pl_module.get_submodule(module_attr)
        if not callable(getattr(module, "num_flops_per_token", None)):
            raise AttributeError(
                f"{type(module).__name__} ({module_attr!r}) has no num_flops_per_token(seq_len)"
            )
        return module
    if callable(getattr(pl_module, "num_flops_per_token", None)):
        return pl_module
    found = [child for child in pl_module.children() if callable(getattr(child, "num_flops_per_token", None))]
    return found[0] if len(found) == 1 else None


@dataclass
class _Clock:
    """A point in the step stream: a CUDA event on the GPU, ``perf_counter`` on the CPU."""

    event: torch.cuda.Event | None
    seconds: float

    @classmethod
    def now(cls, device: torch.device) -> _Clock:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # queued: the host does not wait
            return cls(event, 0.0)
        return cls(None, perf_counter())

    def seconds_until(self, end: _Clock) -> float:
        if self.event is not None and end.event is not None:
            end.event.synchronize()  # the window's one wait
            return self.event.elapsed_time(end.event) / 1e3
        return end.seconds - self.seconds


class Throughput(Callback):
    """Training speed every ``window`` optimizer steps, logged to the Trainer's loggers and shown on the
    progress bar (TQDM and Rich both show ``trainer.progress_bar_metrics``).

    Metrics (``prefix`` + name), each the mean over the window's optimizer steps:

    - ``tokens_per_sec``: tokens of all data-parallel ranks per second. A step's tokens are one rank's batch
      tokens (every position of ``input_ids``, padding included; see ``count_tokens``) times the accumulated
      batches times the data-parallel degree: ``parallel_dims.dp`` under the d9d strategy (pipeline, tensor and
      context peers share a batch), else the world size. ``tokens_per_sec_per_device`` divides by the world size.
    - ``tflops`` and ``tflops_per_device``: model FLOPs, ``flops_per_token(seq_len) * tokens_per_sec / 1e12``
      (per device: also divided by the world size). ``flops_per_token`` is the model's
      ``num_flops_per_token(seq_len)`` (Qwen3: ``6 N + 12 L H d T``, forward + backward, without recomputation),
      found on the LightningModule or its only child that has it, or given.
    - ``mfu``: model FLOPs utilisation in [0, 1], ``flops per second per device / peak``, only when a peak is
      known: ``peak_flops`` (FLOP/s of one device), else the dense bf16 tensor-core peak of the GPU's name from
      :data:`PEAK_BF16_FLOPS` (H100 / H200 SXM: 989.4 TFLOP/s), whatever the training precision. None on CPU.
    - ``step_time``: seconds per optimizer step, from the end of one optimizer step to the end of the next
      (data loading included).
    - ``max_memory_gib``: CUDA only: ``torch.cuda.max_memory_allocated`` of this device since the process started
      (or since the user last reset the peak), in GiB. Nothing on CPU (no per-device allocator peak there).

    The first optimizer step only opens the first window (it holds compilation and warm-up), and a window in
    which validation ran or a checkpoint was saved is dropped. The values are rank 0's timing (every rank runs
    the same steps). On CUDA a window's span is measured by two CUDA events, recorded into the current stream as
    its first and last steps end; only when the window closes does the host wait for the last one: one
    synchronisation per window, none on the steps in between. Rank 0's loggers get the values at the step the
    window closes, whatever ``log_every_n_steps``.
    """

    def __init__(
        self,
        *,
        window: int = 10,
        peak_flops: float | None = None,
        flops_per_token: Callable[[int], float] | None = None,
        module_attr: str | None = None,
        count_tokens: TokenCounter = count_input_tokens,
        prefix: str = "perf/",
        prog_bar: bool = True,
    ) -> None:
        if window < 1:
            raise ValueError(f"Throughput(window={window}): the window must be at least 1 optimizer step")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"Throughput(peak_flops={peak_flops}): give the device's peak in FLOP/s (> 0)")
        self.window = window
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.module_attr = module_attr
        self.count_tokens = count_tokens
        self.prefix = prefix
        self.prog_bar = prog_bar
        self.metrics: dict[str, float] = {}  # the last window's values
        self._reset()

    def _reset(self) -> None:
        self._start: _Clock | None = None  # the end of the optimizer step that opened the window
        self._steps = 0  # optimizer steps in the window
        self._window_tokens = 0
        self._step_tokens = 0  # tokens of the optimizer step in progress (accumulated batches)
        self._seq_len = 0
        self._last_step = -1
        self._dirty = False

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._last_step = trainer.global_step
        self._dp = _data_parallel_degree(trainer)
        self._world = trainer.world_size
        if self.flops_per_token is None:
            model = find_flops_model(pl_module, self.module_attr)
            self._flops_fn: Callable[[int], float] | None = model.num_flops_per_token if model else None  # type: ignore[assignment]
        else:
            self._flops_fn = self.flops_per_token
        self._peak = self.peak_flops if self.peak_flops is not None else peak_flops_of(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens, self._seq_len = self.count_tokens(batch)
        self._step_tokens += tokens

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-step: the optimizer step is not over yet
        self._last_step = trainer.global_step
        step_tokens, self._step_tokens = self._step_tokens * self._dp, 0
        now = _Clock.now(pl_module.device)
        if self._start is None or self._dirty:
            self._start, self._steps, self._window_tokens, self._dirty = now, 0, 0, False
            return
        self._steps += 1
        self._window_tokens += step_tokens
        if self._steps < self.window:
            return
        seconds = self._start.seconds_until(now)
        self.metrics = self._compute(seconds, self._steps, self._window_tokens, pl_module.device)
        self._start, self._steps, self._window_tokens = now, 0, 0
        self._log(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dirty = True

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._dirty = True

    # ------------------------------------------------------------------------------------ the numbers
    def _compute(self, seconds: float, steps: int, tokens: int, device: torch.device) -> dict[str, float]:
        tokens_per_sec = tokens / seconds
        values = {
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / self._world,
            "step_time": seconds / steps,
        }
        if self._flops_fn is not None:
            flops = float(self._flops_fn(self._seq_len)) * tokens_per_sec
            values["tflops"] = flops / 1e12
            values["tflops_per_device"] = flops / self._world / 1e12
            if self._peak is not None:
                values["mfu"] = flops / self._world / self._peak
        if device.type == "cuda":
            values["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return values

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = {self.prefix + name: value for name, value in self.metrics.items()}
        for logger in trainer.loggers:  # at this step, whatever log_every_n_steps (rank 0 writes)
            logger.log_metrics(named, step=trainer.global_step)
        if self.prog_bar:
            # CPU tensors: Lightning reads progress-bar values with .item(), which must not touch the device.
            for name, value in named.items():
                pl_module.log(
                    name, torch.tensor(value), prog_bar=True, logger=False, on_step=True, batch_size=1
                )


def _data_parallel_degree(trainer: pl.Trainer) -> int:
    """``parallel_dims.dp`` of the d9d strategy (ranks that load different batches); the world size else."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    dp = getattr(dims, "dp", None)
    return int(dp) if isinstance(dp, int) else trainer.world_size
