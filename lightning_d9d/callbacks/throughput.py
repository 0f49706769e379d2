"""``Throughput``: tokens/s, TFLOP/s, MFU, step time and peak memory, on the progress bar and in the loggers.

Nothing is read back from the device between window boundaries: on CUDA a window's span is measured with two
``torch.cuda.Event(enable_timing=True)`` (the end one is waited for once, when the window closes), on CPU with
``time.perf_counter``. The tokens read come from the batches' shapes (host-side); the tokens learnt (labels that
are not ``ignore_index``) are counted on the device and read back with the window's end, summed over the
data-parallel ranks by one all-reduce per window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_d9d.models.flops import (
    AttentionShape,
    FlopParams,
    flop_params,
    routed_experts,
    training_flops_per_token,
)
from lightning_d9d.modules.hf_init import is_transformers_model

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

# a device tensor, an int or None (where the batch holds no labels); Any: LightningCLI's parser turns a callable
# default whose annotated return is a union into its import path, a str
LearntCounter = Callable[[Any, int], Any]
"""``(batch, ignore_index) -> tokens learnt`` of one rank's batch (a device tensor is not read back until the window
closes); None where the batch holds no labels."""

DEFAULT_IGNORE_INDEX = -100  # torch's cross-entropy default, and causal_lm_loss's


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


def count_learnt_tokens(batch: Any, ignore_index: int = DEFAULT_IGNORE_INDEX) -> torch.Tensor | None:
    """Tokens a batch learns from: its labels that are not ``ignore_index`` (padding, prompts and document
    boundaries are), counted on the batch's device without a host synchronisation. The labels are
    ``batch["labels"]`` for a mapping, or the second of an ``(input_ids, labels)`` pair of equal shapes; None where
    the batch holds none."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif (
        isinstance(batch, Sequence)
        and len(batch) >= 2
        and all(isinstance(t, torch.Tensor) for t in batch[:2])
    ):
        labels = batch[1] if batch[1].shape == batch[0].shape else None
    else:
        labels = None
    return (labels != ignore_index).sum() if isinstance(labels, torch.Tensor) else None


def loss_ignore_index(pl_module: nn.Module) -> int | None:
    """The label the LightningModule's loss skips: an ``ignore_index`` of the module itself, of one of its public
    attributes (``self.loss_fn = CausalLMLoss(ignore_index=...)``, the ``hparams``) or of a child module
    (``nn.CrossEntropyLoss``); None where none has one. Raises ``ValueError`` naming them where they disagree."""
    holders: dict[str, Any] = {"self": pl_module}
    holders.update((name, value) for name, value in vars(pl_module).items() if not name.startswith("_"))
    holders.update(pl_module.named_children())
    found = {name: _int_attribute(value, "ignore_index") for name, value in holders.items()}
    found = {name: value for name, value in found.items() if value is not None}
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name}.ignore_index={value}" for name, value in found.items())
        raise ValueError(
            f"Throughput: {type(pl_module).__name__} skips different labels ({listed}); pass "
            "Throughput(ignore_index=...) to say which labels are not learnt"
        )
    return next(iter(found.values()), None)


def _int_attribute(value: Any, name: str) -> int | None:
    found = getattr(value, name, None)
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, Sequence) else ()
    for item in items:
        if not isinstance(item, str) and (found := _first_tensor(item)) is not None:
            return found
    return None


def find_flops_model(pl_module: pl.LightningModule, module_attr: str | None = None) -> nn.Module | None:
    """The model whose FLOPs are counted: one with ``num_flops_per_token(seq_len)`` or a ``transformers`` model.
    ``module_attr`` names it (``""`` for the LightningModule), else it is the LightningModule itself or its only
    direct child that is one; None when there is none."""
    if module_attr is not None:
        module = pl_module.get_submodule(module_attr)
        if not _counts_flops(module):
            raise AttributeError(
                f"{type(module).__name__} ({module_attr!r}) has no num_flops_per_token(seq_len) and is not a "
                "transformers model; pass Throughput(flops_per_token=lambda seq_len: ...)"
            )
        return module
    if _counts_flops(pl_module):
        return pl_module
    found = [child for child in pl_module.children() if _counts_flops(child)]
    return found[0] if len(found) == 1 else None


def _counts_flops(module: nn.Module) -> bool:
    return callable(getattr(module, "num_flops_per_token", None)) or is_transformers_model(module)


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

    - ``tokens_per_sec``: tokens read by all data-parallel ranks per second. A step's tokens are one rank's batch
      tokens (every position of ``input_ids``, padding included; see ``count_tokens``) times the accumulated
      batches times the data-parallel degree: ``parallel_dims.dp`` under the d9d strategy (pipeline, tensor and
      context peers share a batch), else the world size. ``tokens_per_sec_per_device`` divides by the world size.
    - ``learnt_tokens_per_sec``: tokens learnt from by all data-parallel ranks per second: labels that are not
      ``ignore_index`` (padding, prompts and document boundaries are not learnt; see ``count_learnt``),
      each rank's own count summed over the data-parallel ranks; ``learnt_tokens_per_sec_per_device`` divides
      by the world size. ``ignore_index`` is the one given, else the loss's own where the module has one
      (:func:`loss_ignore_index`), else -100. Not logged for batches without labels (an info line says so).
    - ``tflops`` and ``tflops_per_device``: model FLOPs, ``flops_per_token(seq_len) * tokens_per_sec / 1e12``
      (per device: also divided by the world size), the tokens read, since every position is computed.
      ``flops_per_token`` is ``6 * N_trained + 4 * N_frozen + 12 * L * H * head_dim * T``
      (:mod:`lightning_d9d.models.flops`): ``N`` the parameters a token multiplies through (no input embedding,
      the head even when tied, the active share of routed experts); a trained weight costs 6 FLOPs per
      parameter (forward, input gradient, weight gradient), a frozen one (LoRA's base, a user's frozen modules)
      4 (no weight gradient); the second term is attention's ``T x T`` matmuls. It is the model's
      ``num_flops_per_token(seq_len)`` where the model has one and trains every weight (our models count ``N``
      from their config); else, for a ``transformers`` model or one with frozen weights, ``N`` counted from
      its parameters (summed over pipeline stages) and ``L, H, head_dim`` read from its config. The model is
      the LightningModule or its only child that has either, or ``module_attr``; or give ``flops_per_token``.
      Where none can be counted, an info line says why.
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
    synchronisation per window, none on the steps in between (the learnt tokens are summed on the device until
    then). Rank 0's loggers get the values at the step the window closes, whatever ``log_every_n_steps``.
    """

    def __init__(
        self,
        *,
        window: int = 10,
        peak_flops: float | None = None,
        flops_per_token: Callable[[int], float] | None = None,
        module_attr: str | None = None,
        count_tokens: TokenCounter = count_input_tokens,
        count_learnt: LearntCounter = count_learnt_tokens,
        ignore_index: int | None = None,
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
        self.count_learnt = count_learnt
        self.ignore_index = ignore_index
        self.prefix = prefix
        self.prog_bar = prog_bar
        self.metrics: dict[str, float] = {}  # the last window's values
        self._explained: set[str] = set()  # the info lines already given
        self._reset()

    def _reset(self) -> None:
        self._start: _Clock | None = None  # the end of the optimizer step that opened the window
        self._steps = 0  # optimizer steps in the window
        self._window_tokens = 0
        self._step_tokens = 0  # tokens of the optimizer step in progress (accumulated batches)
        self._window_learnt: torch.Tensor | int | None = 0  # None once a batch has no labels
        self._step_learnt: torch.Tensor | int | None = 0
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
        found = self.ignore_index if self.ignore_index is not None else loss_ignore_index(pl_module)
        self._ignore = DEFAULT_IGNORE_INDEX if found is None else found
        self._flops_fn = self._find_flops(trainer, pl_module)
        self._peak = self.peak_flops if self.peak_flops is not None else peak_flops_of(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens, self._seq_len = self.count_tokens(batch)
        self._step_tokens += tokens
        if self._step_learnt is None:
            return  # the batches hold no labels (said once)
        learnt = self.count_learnt(batch, self._ignore)
        if learnt is None:
            self._explain_no_labels(batch)
            self._step_learnt = self._window_learnt = None
        else:
            self._step_learnt = self._step_learnt + learnt  # queued on the device: no host wait

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-step: the optimizer step is not over yet
        self._last_step = trainer.global_step
        step_tokens, self._step_tokens = self._step_tokens * self._dp, 0
        step_learnt, self._step_learnt = self._step_learnt, (0 if self._step_learnt is not None else None)
        now = _Clock.now(pl_module.device)
        if self._start is None or self._dirty:
            self._start, self._steps, self._window_tokens, self._dirty = now, 0, 0, False
            self._window_learnt = 0 if step_learnt is not None else None
            return
        self._steps += 1
        self._window_tokens += step_tokens
        if self._window_learnt is not None and step_learnt is not None:
            self._window_learnt = self._window_learnt + step_learnt
        if self._steps < self.window:
            return
        seconds = self._start.seconds_until(now)
        learnt = self._summed_over_data_ranks(trainer, pl_module.device, self._window_learnt)
        self.metrics = self._compute(seconds, self._steps, self._window_tokens, learnt, pl_module.device)
        self._start, self._steps, self._window_tokens = now, 0, 0
        self._window_learnt = 0 if self._window_learnt is not None else None
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
    def _find_flops(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> Callable[[int], float] | None:
        """``flops_per_token`` as the class docstring says; None, with an info line saying why, where it cannot
        be counted. Under pipeline parallelism every rank all-reduces the parameter counts of its stages once."""
        if self.flops_per_token is not None:
            return self.flops_per_token
        model = find_flops_model(pl_module, self.module_attr)
        if model is None:
            self._explain(
                f"Throughput: no TFLOP/s or MFU: {type(pl_module).__name__} holds no model with "
                "num_flops_per_token(seq_len) and no transformers model (or several); pass module_attr='...' or "
                "flops_per_token=lambda seq_len: ..."
            )
            return None
        config = getattr(model, "config", None)
        params = _summed_over_pipeline(trainer, pl_module.device, flop_params(model, routed_experts(config)))
        attention = AttentionShape.of(config) if config is not None else None
        own: Callable[[int], float] | None = getattr(model, "num_flops_per_token", None)
        if own is not None and (params.frozen == 0 or attention is None):
            if params.frozen:
                self._explain(
                    f"Throughput: {type(model).__name__}.num_flops_per_token counts its frozen weights as trained "
                    "(its config gives no num_hidden_layers / num_attention_heads to count them apart)"
                )
            return own
        if attention is None:
            self._explain(
                f"Throughput: no TFLOP/s or MFU: {type(model).__name__}'s config has no num_hidden_layers / "
                "num_attention_heads to count attention's FLOPs from; pass flops_per_token=lambda seq_len: ..."
            )
            return None
        return partial(training_flops_per_token, params, attention)

    def _summed_over_data_ranks(
        self, trainer: pl.Trainer, device: torch.device, count: torch.Tensor | int | None
    ) -> int | None:
        """The window's learnt tokens of every data-parallel rank (one all-reduce; every rank closes the window
        at the same step)."""
        if count is None:
            return None
        total = torch.as_tensor(count, dtype=torch.int64, device=device).clone()
        if self._dp > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=_data_parallel_group(trainer))
        return int(total.item())

    def _compute(
        self, seconds: float, steps: int, tokens: int, learnt: int | None, device: torch.device
    ) -> dict[str, float]:
        tokens_per_sec = tokens / seconds
        values = {
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / self._world,
            "step_time": seconds / steps,
        }
        if learnt is not None:
            values["learnt_tokens_per_sec"] = learnt / seconds
            values["learnt_tokens_per_sec_per_device"] = learnt / seconds / self._world
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

    def _explain_no_labels(self, batch: Any) -> None:
        self._explain(
            f"Throughput: no learnt_tokens_per_sec: the batch ({type(batch).__name__}) holds no labels (a "
            "'labels' key, or the second of an (input_ids, labels) pair); pass "
            "count_learnt=lambda batch, ignore_index: ..."
        )

    def _explain(self, line: str) -> None:
        if line not in self._explained:
            self._explained.add(line)
            rank_zero_info(line)


def _data_parallel_degree(trainer: pl.Trainer) -> int:
    """``parallel_dims.dp`` of the d9d strategy (ranks that load different batches); the world size else."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    dp = getattr(dims, "dp", None)
    return int(dp) if isinstance(dp, int) else trainer.world_size


def _data_parallel_group(trainer: pl.Trainer) -> dist.ProcessGroup | None:
    """The ranks :func:`_data_parallel_degree` counts: the d9d strategy's ``dp`` view, else the world (None)."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or getattr(dims, "mesh", None) is None:
        return None
    return dims.mesh_for("dp").get_group()


def _summed_over_pipeline(trainer: pl.Trainer, device: torch.device, params: FlopParams) -> FlopParams:
    """``params`` of every pipeline stage: a pipeline rank's model holds only its own stages' layers."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or getattr(dims, "pp", 1) == 1 or not dist.is_initialized():
        return params
    counts = torch.tensor([params.trained, params.frozen], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=dims.mesh_for("pp").get_group())
    return FlopParams(trained=int(counts[0]), frozen=int(counts[1]))
