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

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.pipeline import StageLayout, check_pipeline_config
from lightning_d9d.pipeline.checks import check_pipeline_model


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
    tied = Qwen3Config.tiny(tie_word_embeddings=True, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"ties parameters \(model.embed_tokens.weight = lm_head.weight\)"):
        _check(tied, pp=2)
    _check(tied, pp=1)  # one stage: ties are fine


def test_a_built_model_fails_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(self: object) -> None:
        raise AssertionError("the launcher started the other processes")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    trainer = L.Trainer(
        strategy=D9DStrategy(pp=2), accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
    )
    with pytest.raises(ValueError, match="ties parameters"):
        trainer.fit(LM(Qwen3Config.tiny(tie_word_embeddings=True), eager=True))
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
