"""``Throughput`` on CPU against an injected clock: its fields reach the progress bar and the loggers, and the
numbers are the window's tokens over the window's seconds; a ``transformers`` model gets TFLOP/s and MFU from
its shape, frozen weights (LoRA) count 4 FLOPs per parameter, and the tokens learnt leave out masked labels (no
multi-process run: the data-parallel count is checked in tests/strategies/test_lm_metrics_trainer.py, on the
example's dp=2 and pp=2 runs)."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import lightning as L
import pytest
import torch
import transformers  # a test dependency: a broken install must fail, not skip
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

import lightning_d9d.callbacks.throughput as throughput
from lightning_d9d.callbacks import Throughput, count_input_tokens, peak_flops_of
from lightning_d9d.callbacks.throughput import count_learnt_tokens, loss_ignore_index
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.models.flops import (
    AttentionShape,
    FlopParams,
    flop_params,
    routed_experts,
    training_flops_per_token,
)
from lightning_d9d.modules.loss import CausalLMLoss
from lightning_d9d.plans.lora import LoRA, apply_lora

BATCH, SEQ = 4, 8
# seconds between consecutive optimizer-step ends; the first step only opens the first window
STEP_SECONDS = [0.5, 2.0, 1.0, 3.0, 0.25, 4.0, 1.5]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def num_flops_per_token(self, seq_len: int) -> int:
        return 1000 * seq_len + 7  # not the real count: any function of seq_len shows it is the one used


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 32, (count, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": one[:, :-1], "labels": one[:, 1:]} for one in ids]


def _fit(
    monkeypatch: pytest.MonkeyPatch,
    callback: Throughput,
    steps: int,
    accumulate_batches: int,
    module: L.LightningModule | None = None,
    batches: list[Any] | None = None,
) -> Any:
    ticks = iter(accumulate([10.0, *STEP_SECONDS]))
    monkeypatch.setattr(throughput, "perf_counter", lambda: next(ticks))  # read once per optimizer step
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate_batches,
        callbacks=[callback],
        logger=logger,
        log_every_n_steps=1000,  # the callback logs when its window closes, not on Lightning's schedule
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    data = batches if batches is not None else _batches(steps * accumulate_batches)
    trainer.fit(module or TinyModule(), DataLoader(data, batch_size=None))
    return trainer, logger


def test_tokens_flops_and_mfu_against_an_injected_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    window, accumulation, peak = 3, 2, 5e9
    trainer, logger = _fit(monkeypatch, Throughput(window=window, peak_flops=peak), 7, accumulation)
    step_tokens = BATCH * SEQ * accumulation  # one process: dp = 1
    flops_per_token = 1000 * SEQ + 7
    windows = [STEP_SECONDS[0:3], STEP_SECONDS[3:6]]  # steps 2-4 and 5-7; step 1 opened the first window
    expected = []
    for seconds in windows:
        tokens_per_sec = window * step_tokens / sum(seconds)
        expected.append(
            {
                "perf/tokens_per_sec": tokens_per_sec,
                "perf/tokens_per_sec_per_device": tokens_per_sec,
                "perf/learnt_tokens_per_sec": tokens_per_sec,  # no label is ignore_index here
                "perf/learnt_tokens_per_sec_per_device": tokens_per_sec,
                "perf/step_time": sum(seconds) / window,
                "perf/tflops": flops_per_token * tokens_per_sec / 1e12,
                "perf/tflops_per_device": flops_per_token * tokens_per_sec / 1e12,
                "perf/mfu": flops_per_token * tokens_per_sec / peak,
            }
        )
    perf = [(step, metrics) for step, metrics in logger.logged if any(k.startswith("perf/") for k in metrics)]
    assert [step for step, _ in perf] == [4, 7]
    for (_, actual), wanted in zip(perf, expected, strict=True):
        assert actual.keys() == wanted.keys()  # CPU: no memory field
        for name, value in wanted.items():
            assert actual[name] == pytest.approx(value, rel=1e-12), name
    bar = trainer.progress_bar_metrics
    assert set(expected[-1]) <= set(bar)
    for name, value in expected[-1].items():
        assert bar[name] == pytest.approx(value, rel=1e-6), name  # Lightning keeps them as float32


def test_mfu_only_with_a_peak_and_flops_only_with_a_model_count(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, _ = _fit(monkeypatch, Throughput(window=2), 3, 1)
    assert "perf/tflops" in trainer.progress_bar_metrics  # the model's num_flops_per_token was found
    assert "perf/mfu" not in trainer.progress_bar_metrics  # CPU: no peak unless given
    counted = Throughput(window=2, flops_per_token=lambda seq_len: 0.0, prog_bar=False)
    trainer, logger = _fit(monkeypatch, counted, 3, 1)
    assert not any(k.startswith("perf/") for k in trainer.progress_bar_metrics)
    assert counted.metrics["tflops"] == 0.0 and "perf/tokens_per_sec" in logger.logged[-1][1]


def test_token_counting_and_peaks() -> None:
    assert count_input_tokens({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)}) == (15, 5)
    assert count_input_tokens((torch.zeros(2, 7, dtype=torch.long), torch.zeros(2))) == (14, 7)
    with pytest.raises(ValueError, match="count_tokens"):
        count_input_tokens({"text": "no tensors"})
    assert peak_flops_of(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)


# ------------------------------------------------------------------------------ transformers models and LoRA
# A tiny transformers Qwen3: hidden 32, MLP 64, vocabulary 128, 2 layers of 4 query heads and 2 KV heads of 8.
# N by hand (no input embedding; the untied head counted):
#   per layer: q 32*32 = 1024, k 32*16 = 512, v 512, o 1024, q/k norms 8 + 8, gate / up / down 3 * 32*64 = 6144,
#              two layer norms 2 * 32: 1024 + 512 + 512 + 1024 + 16 + 6144 + 64 = 9296
#   model:     2 * 9296 + final norm 32 + head 128*32 = 4096: 22720
# attention per token: 12 * layers * heads * head_dim * T = 12 * 2 * 4 * 8 * 8 = 6144 at T = SEQ = 8
HF_N, HF_ATTENTION = 22720, 6144
# With layer 0 a sliding window of 4 (layer 1 full): 12 * heads * head_dim * (T + min(T, 4)) = 12 * 4 * 8 * 12
HF_ATTENTION_WINDOWED = 4608
# LoRA rank 4 on the 7 projections: rank * (in + out) each, per layer q 4*64 = 256, k 4*48 = 192, v 192,
# o 256, gate / up / down 4*96 = 384 each: 2048; two layers: 4096 trained, the 22720 of the base all frozen.
LORA_TRAINED = 4096


def _hf_qwen3(**windows: Any) -> nn.Module:
    config = transformers.Qwen3Config(
        **windows,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


class HFModule(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _hf_batches(count: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (count, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": one[:, :-1], "labels": one[:, 1:]} for one in ids]


def _window_tokens_per_sec() -> float:
    """Tokens read per second of the first window of a window-2, one-batch-per-step run."""
    return 2 * BATCH * SEQ / sum(STEP_SECONDS[0:2])


WINDOW = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True)


@pytest.mark.parametrize(
    ("lora", "windows", "flops_per_token"),
    [
        (False, {}, 6 * HF_N + HF_ATTENTION),  # every weight trained
        (True, {}, 6 * LORA_TRAINED + 4 * HF_N + HF_ATTENTION),  # the base frozen: forward + input gradient
        (False, WINDOW, 6 * HF_N + HF_ATTENTION_WINDOWED),  # a windowed layer meets at most 4 keys a query
    ],
    ids=["trained", "lora", "sliding window"],
)
def test_transformers_model_gets_tflops_and_mfu(
    monkeypatch: pytest.MonkeyPatch, lora: bool, windows: dict[str, Any], flops_per_token: int
) -> None:
    model = _hf_qwen3(**windows)
    assert sum(p.numel() for p in model.parameters()) - 128 * 32 == HF_N  # the hand count is this model's
    if lora:
        apply_lora(model, LoRA(rank=4), seed=0)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == LORA_TRAINED
    peak = 1e9
    callback = Throughput(window=2, peak_flops=peak, prog_bar=False)
    _fit(monkeypatch, callback, 3, 1, HFModule(model), _hf_batches(3))
    flops = flops_per_token * _window_tokens_per_sec()
    assert callback.metrics["tflops"] == pytest.approx(flops / 1e12, rel=1e-12)
    assert callback.metrics["mfu"] == pytest.approx(flops / peak, rel=1e-12)


@pytest.mark.parametrize(
    ("config", "windowed"),
    [
        (dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=1024), 5),  # Gemma 3
        (dict(sliding_window=4096), 6),  # Mistral: no layer_types, every layer
        (dict(sliding_window=4096, use_sliding_window=False), 0),  # Qwen2's switch off
        (dict(sliding_window=None), 0),
    ],
    ids=["layer types", "every layer", "switched off", "none"],
)
def test_attention_flops_count_a_window_s_keys(config: dict[str, Any], windowed: int) -> None:
    shape = AttentionShape.of(dict(num_hidden_layers=6, num_attention_heads=2, head_dim=4, **config))
    assert shape is not None and shape.windowed_layers == windowed
    full = 12 * 2 * 4 * 6 * 8192
    expected = full - 12 * 2 * 4 * windowed * (8192 - min(8192, config["sliding_window"] or 8192))
    assert training_flops_per_token(FlopParams(trained=0), shape, 8192) == expected
    assert training_flops_per_token(FlopParams(trained=0), shape, 512) == 12 * 2 * 4 * 6 * 512  # T under W


def test_module_count_is_the_config_count_of_our_models_and_transformers_moe() -> None:
    """N counted from the parameters is what our models count from their config: dense, MoE with its active
    experts, and transformers' Qwen3-MoE of the same shape (its experts fused under the same name)."""
    with torch.device("meta"):
        dense = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=True))
        moe_config = Qwen3MoeConfig.tiny()
        moe = Qwen3MoeForCausalLM(moe_config)
        hf_moe = transformers.Qwen3MoeForCausalLM(moe_config.to_hf_config())
    assert flop_params(dense).trained == dense.config.num_params(include_embedding=False)
    active = moe_config.num_params(include_embedding=False, active=True)
    assert active < moe_config.num_params(include_embedding=False)  # the count does depend on the experts
    assert flop_params(moe, routed_experts(moe_config)).trained == active
    assert flop_params(hf_moe, routed_experts(hf_moe.config)).trained == active


# ------------------------------------------------------------------------------------------ tokens learnt
def _masked_batches(count: int, ignore: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Batches whose rows mask a prompt of (batch + row) % 3 labels and a padding of row % 2: the batches and
    their learnt tokens, counted from those lengths."""
    batches, learnt = [], []
    for index, batch in enumerate(_batches(count)):
        labels = batch["labels"].clone()
        kept = 0
        for row in range(BATCH):
            prompt, padding = (index + row) % 3, row % 2
            labels[row, :prompt] = ignore
            labels[row, SEQ - padding :] = ignore
            kept += SEQ - prompt - padding
        batches.append({"input_ids": batch["input_ids"], "labels": labels})
        learnt.append(kept)
    return batches, learnt


class IgnoringModule(TinyModule):
    """A module whose loss skips the label -1 (not torch's -100)."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = CausalLMLoss(ignore_index=-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return self.loss_fn(logits, batch["labels"])


@pytest.mark.parametrize("ignore", [-100, -1], ids=["default", "the loss's own"])
def test_learnt_tokens_leave_out_prompts_and_padding(monkeypatch: pytest.MonkeyPatch, ignore: int) -> None:
    window, accumulation = 3, 2
    batches, learnt = _masked_batches(7 * accumulation, ignore)
    module = IgnoringModule() if ignore == -1 else TinyModule()
    _, logger = _fit(monkeypatch, Throughput(window=window), 7, accumulation, module, batches)
    windows = [(STEP_SECONDS[0:3], learnt[2:8]), (STEP_SECONDS[3:6], learnt[8:14])]  # step 1: batches 0-1
    perf = [metrics for _, metrics in logger.logged if "perf/tokens_per_sec" in metrics]
    assert len(perf) == 2
    for actual, (seconds, counts) in zip(perf, windows, strict=True):
        assert sum(counts) < window * accumulation * BATCH * SEQ  # some labels are masked
        assert actual["perf/learnt_tokens_per_sec"] == pytest.approx(sum(counts) / sum(seconds), rel=1e-12)
        assert actual["perf/learnt_tokens_per_sec_per_device"] == actual["perf/learnt_tokens_per_sec"]
        read = window * accumulation * BATCH * SEQ / sum(seconds)
        assert actual["perf/tokens_per_sec"] == pytest.approx(read, rel=1e-12)  # padding is still read


def test_why_nothing_is_logged_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(throughput, "rank_zero_info", said.append)

    class Plain(TinyModule):  # no num_flops_per_token, no transformers model
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))

    unlabelled = [(batch["input_ids"],) for batch in _batches(4)]

    class Unlabelled(Plain):
        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(batch[0]).square().mean()

    callback = Throughput(window=1, prog_bar=False)
    _fit(monkeypatch, callback, 4, 1, Unlabelled(), unlabelled)
    assert "tflops" not in callback.metrics and "learnt_tokens_per_sec" not in callback.metrics
    assert len(said) == 2, said  # four steps, each reason once
    assert "no TFLOP/s or MFU" in said[0] and "flops_per_token" in said[0]
    assert "no learnt_tokens_per_sec" in said[1] and "count_learnt" in said[1]


def test_learnt_counting_and_the_loss_ignore_index() -> None:
    labels = torch.tensor([[-100, 3, 4, -100], [5, -100, 6, 7]])
    assert int(count_learnt_tokens({"input_ids": labels, "labels": labels})) == 5
    assert int(count_learnt_tokens((torch.zeros_like(labels), labels), ignore_index=5)) == 7
    assert count_learnt_tokens((torch.zeros(2, 4), torch.zeros(2))) is None  # not a labels tensor
    assert loss_ignore_index(IgnoringModule()) == -1
    assert loss_ignore_index(TinyModule()) is None
    conflicting = IgnoringModule()
    conflicting.criterion = nn.CrossEntropyLoss(ignore_index=-7)
    with pytest.raises(
        ValueError, match=r"loss_fn.ignore_index=-1, criterion.ignore_index=-7.*Throughput\(ignore_index"
    ):
        loss_ignore_index(conflicting)
