"""A 2- or 4-process run of the example's module with ``Throughput`` and its validation perplexity, for
``test_lm_metrics_trainer.py``: ``python lm_metrics_script.py --fork '<json list of configs>'`` forks each
config's ``devices`` ranks after the imports (``trainer_script.fork_ranks``), or ``torchrun --nproc-per-node=N
lm_metrics_script.py '<json list of configs>'``.

Each config trains two steps (``fit``: throughput every step) or none, then validates on padded data (ranks and microbatches
hold different token counts). Rank 0 saves the logged values and the full parameters, from which the test
computes the perplexity in one process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from torchmetrics import SumMetric

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import trainer_script
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus
from reference import PaddedCorpus
from trainer_script import full_parameters

from lightning_d9d import D9DStrategy
from lightning_d9d.callbacks import Throughput
from lightning_d9d.models import Qwen3Config
from lightning_d9d.modules.loss import causal_lm_loss

SEQ_LEN, GLOBAL_BATCH = 16, 8


class RecordThroughput(Callback):
    """What ``Throughput`` put on the progress bar after every optimizer step (it runs before this one)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        bar = trainer.progress_bar_metrics
        self.steps.append({k: float(v) for k, v in bar.items() if k.startswith("perf/")})


class CountingPretraining(Qwen3Pretraining):
    """The example's module plus a summed metric, the validation tokens: a sum counts a rank twice if the metric
    syncs over ranks that hold the same tokens (tp or pp peers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.val_tokens = SumMetric()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.val_tokens.update(causal_lm_loss.count(batch["labels"]).float())
        self.log("val/tokens", self.val_tokens)


def val_corpus(vocab_size: int) -> PaddedCorpus:
    return PaddedCorpus(SyntheticCorpus(vocab_size, SEQ_LEN, 2 * GLOBAL_BATCH, first_sample=10_000))


def main(config: dict[str, Any]) -> None:
    L.seed_everything(7, verbose=False)
    model_config = Qwen3Config.tiny(**config.get("model", {}))
    dims, dp = config["dims"], config["dp"]
    record = RecordThroughput()
    trainer = L.Trainer(
        strategy=D9DStrategy(**dims),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=2,
        callbacks=[Throughput(window=1), record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = CountingPretraining(model_config, lr=1e-3, warmup_steps=1, max_steps=2)
    if config["fit"]:
        train = SyntheticCorpus(model_config.vocab_size, SEQ_LEN, GLOBAL_BATCH * 2)
        trainer.fit(module, DataLoader(train, batch_size=GLOBAL_BATCH // dp))
    metrics = trainer.validate(
        module, DataLoader(val_corpus(model_config.vocab_size), batch_size=GLOBAL_BATCH // dp), verbose=False
    )[0]
    params = full_parameters(module)
    if trainer.strategy.parallel_dims.pp_enabled:
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, params)
        params = {name: tensor for part in gathered for name, tensor in part.items()}
    if trainer.is_global_zero:
        result = {"val": dict(metrics), "throughput": record.steps, "params": params}
        torch.save(result, config["out"])
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1] == "--fork":  # the ranks run trainer_script's loop over the configs, with this main
        trainer_script.main = main
        sys.exit(trainer_script.fork_ranks(json.loads(sys.argv[2])))
    for one in json.loads(sys.argv[1]):
        main(one)
    if dist.is_initialized():  # before interpreter exit (see trainer_script.py)
        dist.destroy_process_group()
