"""Pipeline settings that the model cannot take (more stages than layers, tied weights with pp > 1) fail before
anything depends on them: before Lightning starts the other processes when the model is built already, and on
every rank alike before the first collective when ``configure_model`` builds it."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.pipeline import StageLayout, check_pipeline_config
from lightning_d9d.pipeline.checks import check_batches_split, check_pipeline_model


class LM(L.LightningModule):
    """A LightningModule whose model is built eagerly (``eager``) or in ``configure_model`` on meta."""

    def __init__(self, config: Qwen3Config, eager: bool) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3ForCausalLM(config) if eager else None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = Qwen3ForCausalLM(self.config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        raise AssertionError("the settings must fail before training")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _check(config: Qwen3Config, pp: int, schedule: str = "1F1B", **layout: object) -> None:
    owner = LM(config, eager=False)
    owner.configure_model()
    check_pipeline_model(owner, check_pipeline_config(pp, schedule, None, None), pp, StageLayout(**layout))  # type: ignore[arg-type]


def test_the_checks_name_the_numbers_and_the_fix() -> None:
    untied = Qwen3Config.tiny(tie_word_embeddings=False, num_hidden_layers=2)
    _check(untied, pp=2)  # fits: nothing raised
    with pytest.raises(
        ValueError, match=r"2 layers, fewer than the 4 pipeline stages .*lower pp or stages_per"
    ):
        _check(untied, pp=2, schedule="Interleaved1F1B")
    with pytest.raises(
        ValueError, match=r"layers_per_stage \[3, 1\] must have 2 positive entries adding up to 2"
    ):
        _check(untied, pp=2, layers_per_stage=[3, 1])
    tied = Qwen3Config.tiny(tie_word_embeddings=True, num_hidden_layers=4)
    _check(tied, pp=2)  # the embedding's and the head's copies on two ranks train as one
    _check(tied, pp=2, schedule="Interleaved1F1B")  # stage 0 on rank 0, stage 3 on rank 1
    with pytest.raises(
        ValueError,
        match=r"ties parameters \(model.embed_tokens.weight = lm_head.weight\), and the ZBVZeroBubble schedule "
        r"puts the first and the last stage on one rank as two FSDP units",
    ):
        _check(tied, pp=2, schedule="ZBVZeroBubble")
    _check(tied, pp=1)  # one stage: ties are fine


def test_a_built_model_fails_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(self: object) -> None:
        raise AssertionError("the launcher started the other processes")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    trainer = L.Trainer(
        strategy=D9DStrategy(pp=2, pipeline_schedule="ZBVZeroBubble"),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match="ties parameters"):
        trainer.fit(LM(Qwen3Config.tiny(tie_word_embeddings=True, num_hidden_layers=4), eager=True))
    assert not dist.is_initialized()


def _fit_meta_model_with_a_v_schedule() -> str:
    os.environ.update(
        GROUP_RANK="0", LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], TORCHELASTIC_RUN_ID="pipeline-settings"
    )
    trainer = L.Trainer(
        strategy=D9DStrategy(pp=2, pipeline_schedule="ZBVZeroBubble"),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(LM(Qwen3Config.tiny(tie_word_embeddings=True, num_hidden_layers=4), eager=False))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_model_built_in_configure_model_fails_on_every_rank_alike() -> None:
    # Under a V schedule rank 0 holds the first and the last stage, so only rank 1 would find the tie while
    # carving: rank 0 would go on into a collective and wait for it. The check runs on both before that.
    messages = run_distributed(_fit_meta_model_with_a_v_schedule, 2, timeout=120)
    assert all("ties parameters (model.embed_tokens.weight = lm_head.weight)" in m for m in messages), (
        messages
    )


def test_a_batch_the_schedule_cannot_split_is_named_before_training() -> None:
    def loader(samples: int, batch: int, **options: object) -> DataLoader:
        return DataLoader(torch.zeros(samples, 3), batch_size=batch, **options)  # type: ignore[arg-type]

    with pytest.raises(
        ValueError, match=r"per-rank batch size \(6\) must be divisible by microbatches \(4\)"
    ):
        check_batches_split(loader(16, 6), microbatches=4, limit_batches=1.0)
    message = (
        r"partial batch of 2 samples \(10 samples per rank, batch size 4\).* 4 microbatches: pass drop_last"
    )
    with pytest.raises(ValueError, match=message):
        check_batches_split(loader(10, 4), microbatches=4, limit_batches=1.0)
    check_batches_split(loader(10, 4, drop_last=True), microbatches=4, limit_batches=1.0)
    check_batches_split(loader(10, 4), microbatches=2, limit_batches=1.0)  # 2 splits into 2
    check_batches_split(loader(10, 4), microbatches=4, limit_batches=2)  # the partial third is never drawn
    check_batches_split(loader(10, 4), microbatches=4, limit_batches=0.5)
    with pytest.raises(ValueError, match="partial batch"):
        check_batches_split(loader(10, 4), microbatches=4, limit_batches=3)


def _fit_with_a_partial_last_batch() -> str:
    os.environ.update(
        GROUP_RANK="0", LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], TORCHELASTIC_RUN_ID="pipeline-batches"
    )
    trainer = L.Trainer(
        strategy=D9DStrategy(pp=2, microbatches=4),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    config = Qwen3Config.tiny(tie_word_embeddings=False, num_hidden_layers=2)
    try:  # 10 sequences in batches of 4: the third has 2, which 4 microbatches cannot split
        trainer.fit(LM(config, eager=True), DataLoader(torch.zeros(10, 8, dtype=torch.long), batch_size=4))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_partial_last_batch_under_pp_fails_when_fit_starts_on_every_rank() -> None:
    # LM.training_step raises if reached: the check must come before the first batch, not at the epoch's end
    messages = run_distributed(_fit_with_a_partial_last_batch, 2, timeout=120)
    assert all("partial batch of 2 samples (10 samples per rank, batch size 4)" in m for m in messages), (
        messages
    )
