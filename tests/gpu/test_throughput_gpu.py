"""``Throughput`` on one CUDA GPU adds no host synchronisation between window boundaries, and its CUDA-event
timing agrees with the host's clock. Run on a CUDA GPU: ``pytest -m gpu``.

Synchronisations are counted with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising
call: ``.item()``, ``.cpu()``, ``torch.cuda.synchronize()``, ...), around each of the callback's hooks and,
for the record, around each whole training step. torch flags neither ``Event.synchronize()``
(the callback's one wait per window) nor ``torch.cuda.synchronize()``, so each hook also runs behind 40 ms of
queued GPU work and its host time shows whether it waited for the GPU.

Measured on an H200 (torch 2.11, Lightning 2.6.6): Throughput 0 flagged syncs in every hook call, and only the
hooks that close a window wait for the GPU; the whole training step flags 0 syncs except 1 on the first step
with Lightning's default strategy, 0 on every step with ``strategy="d9d"``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d.callbacks import Throughput

pytestmark = pytest.mark.gpu

WINDOW, STEPS, BATCH, SEQ, WIDTH = 4, 14, 8, 256, 1024
SPIN_MS = 40


@contextmanager
def counting_syncs(counts: list[int]) -> Iterator[None]:
    """Appends the number of host synchronisations inside the block to ``counts``."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counts.append(sum("synchroniz" in str(w.message) for w in caught))


class CountedThroughput(Throughput):
    """Each hook call's synchronisations, whether it closed a window, and how long the host spent in it while
    ``SPIN_MS`` of GPU work queued just before it was still running: a hook that waits for the GPU in any way
    (including ``Event.synchronize``, which the sync debug mode does not flag) takes about that long."""

    def __init__(self, cycles_per_ms: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spin = int(SPIN_MS * cycles_per_ms)
        self.calls: list[tuple[str, int, float, bool]] = []  # (hook, syncs, host ms, window closed)

    def _counted(self, hook: str, call: Callable[[], None]) -> None:
        before, counts = self.metrics, []  # a closing window puts a new dict there
        torch.cuda._sleep(self.spin)
        started = time.perf_counter()
        with counting_syncs(counts):
            call()
        host_ms = (time.perf_counter() - started) * 1e3
        self.calls.append((hook, counts[0], host_ms, self.metrics is not before))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._counted(
            "start",
            lambda: super(CountedThroughput, self).on_train_batch_start(trainer, pl_module, batch, batch_idx),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._counted(
            "end",
            lambda: super(CountedThroughput, self).on_train_batch_end(
                trainer, pl_module, outputs, batch, batch_idx
            ),
        )


class WholeStep(L.Callback):
    """Synchronisations from the start to the end of every training batch (Lightning's loop included), and the
    host's clock at every step end after waiting for the GPU (for comparison with the events)."""

    def __init__(self) -> None:
        self.syncs: list[int] = []
        self._block: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._block = counting_syncs(self.syncs)
        self._block.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._block.__exit__(None, None, None)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, WIDTH)
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
        self.head = nn.Linear(WIDTH, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))

    def num_flops_per_token(self, seq_len: int) -> int:
        return 6 * sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed"))


class MlpModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Mlp()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


def _data(count: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 512, (count, BATCH, SEQ + 1))
    return [{"input_ids": one[:, :-1], "labels": one[:, 1:]} for one in ids]


@pytest.mark.parametrize("strategy", ["auto", "d9d"])
def test_no_host_sync_between_window_boundaries(strategy: str) -> None:
    import lightning_d9d  # noqa: F401  (registers strategy="d9d")

    callback, whole = CountedThroughput(_cycles_per_ms(), window=WINDOW), WholeStep()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        max_steps=STEPS,
        callbacks=[whole, callback],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    started = time.perf_counter()
    trainer.fit(MlpModule(), DataLoader(_data(STEPS), batch_size=None))
    elapsed = time.perf_counter() - started

    # The probe sees a synchronisation when there is one.
    control: list[int] = []
    with counting_syncs(control):
        torch.ones(1, device="cuda").item()
    assert control == [1]

    between = [(syncs, host_ms) for _, syncs, host_ms, closed in callback.calls if not closed]
    closing = [(syncs, host_ms) for _, syncs, host_ms, closed in callback.calls if closed]
    print(f"\nsyncs per training step (Lightning's loop + this model): {whole.syncs}")
    print(f"Throughput between boundaries (syncs, host ms): {between}")
    print(f"Throughput closing a window (syncs, host ms): {closing}")
    print(f"last window: {callback.metrics}; the whole fit took {elapsed:.2f} s on the host")
    assert len(closing) == (STEPS - 1) // WINDOW  # step 1 opens the first window
    assert len(between) == 2 * STEPS - len(closing)
    assert all(syncs == 0 and host_ms < SPIN_MS / 4 for syncs, host_ms in between), between
    # the one wait per window: for the end event, queued behind the spin
    assert all(host_ms > SPIN_MS / 2 for _, host_ms in closing), closing

    values = callback.metrics
    assert {"tokens_per_sec", "tflops_per_device", "step_time", "max_memory_gib"} <= set(values)
    assert values["tokens_per_sec"] * values["step_time"] == pytest.approx(BATCH * SEQ)
    assert 0 < values["max_memory_gib"] < 140
    assert 0 < values["step_time"] < elapsed / WINDOW  # a window's steps took less than the whole fit
    # two spins per step, measured on the GPU; a spin is calibrated in clock cycles, and the clock moves
    # (one H200 run measured 68.5 ms for the two 40 ms spins), so require more than one spin
    assert values["step_time"] > SPIN_MS / 1e3
    if "h100" in torch.cuda.get_device_name().lower() or "h200" in torch.cuda.get_device_name().lower():
        assert 0 < values["mfu"] < 1
    assert "perf/tokens_per_sec" in trainer.progress_bar_metrics


def test_cuda_event_timing_matches_the_host_clock() -> None:
    """A window of steps that each take a known GPU time (a spin of ``torch.cuda._sleep``) reads that time."""
    cycles_per_ms = _cycles_per_ms()

    class Sleepy(MlpModule):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            torch.cuda._sleep(int(50 * cycles_per_ms))  # 50 ms of GPU time per step
            return super().training_step(batch, batch_idx)

    callback = Throughput(window=3)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=7,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(Sleepy(), DataLoader(_data(7), batch_size=None))
    assert 0.045 < callback.metrics["step_time"] < 0.080, callback.metrics


def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    return 10**8 / start.elapsed_time(end)
