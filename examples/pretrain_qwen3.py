"""Pretrain a small Qwen3-MoE (or dense Qwen3: ``--model tiny``) with ``Trainer(strategy="d9d")``.

The defaults train a tiny Qwen3-MoE (3 layers, the middle one dense, 8 experts, top-2, load-balancing loss,
auxiliary-loss-free balancing: each router's selection bias moved after every optimizer step by the
``ExpertLoadBalancing`` callback, which also logs each MoE layer's expert load as ``moe/layer{i}/load_*``) on a
synthetic corpus in 2 CPU processes in about a minute:

    python examples/pretrain_qwen3.py
    python examples/pretrain_qwen3.py --accelerator gpu --devices 8 --precision bf16-mixed --model 0.6b \
        --seq-len 2048 --batch-size 64 --max-steps 1000

``--model hf-qwen3`` (``hf-qwen3-moe``) trains ``transformers``' own ``Qwen3ForCausalLM``
(``Qwen3MoeForCausalLM``) of the same shape as ``tiny`` (``tiny-moe``) the same way, through the strategy's
``transformers`` adapter (docs/transformers.md); ``transformers`` is imported only then. ``--tp 2`` splits it
(or our model) with tensor + sequence parallelism instead of FSDP.

The corpus is a random "bigram language": every token has a few likely successors, so the loss falls from
ln(vocab) towards the corpus entropy, which the script prints. Swap ``SyntheticCorpus`` for any dataset that
yields ``{"input_ids", "labels"}``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

import lightning_d9d  # noqa: F401  (registers strategy="d9d")
from lightning_d9d import D9DStrategy, model_loss
from lightning_d9d.callbacks import GarbageCollection, Throughput
from lightning_d9d.callbacks.moe import ExpertLoadBalancing
from lightning_d9d.compat import should_accumulate
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.metrics import CausalLMPerplexity
from lightning_d9d.optim import MasterWeightAdamW


def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The model's inputs of a batch: the ids, and for packed rows (``lightning_d9d.data.PackedDataset``) the
    positions that restart per document, so that attention stays inside each document (docs/packing.md)."""
    if "position_ids" in batch:
        return batch["input_ids"], batch["position_ids"]
    return (batch["input_ids"],)


class SyntheticCorpus(Dataset):
    """Sequences from a fixed random bigram model; sample ``i`` is the same on every rank and every run."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        num_samples: int,
        *,
        successors: int = 4,
        seed: int = 1234,
        first_sample: int = 0,
    ):
        generator = torch.Generator().manual_seed(seed)
        self.seq_len, self.num_samples, self.seed, self.first_sample = (
            seq_len,
            num_samples,
            seed,
            first_sample,
        )
        self.next_tokens = torch.randint(0, vocab_size, (vocab_size, successors), generator=generator)
        weights = torch.rand(successors, generator=generator) + 0.1
        self.probs = weights / weights.sum()
        self.vocab_size = vocab_size

    def entropy(self) -> float:
        """The best loss a model can reach (nats per token), ignoring successor collisions."""
        return float(-(self.probs * self.probs.log()).sum())

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_sample + index)
        choices = torch.multinomial(self.probs, self.seq_len, replacement=True, generator=generator).tolist()
        token = int(torch.randint(0, self.vocab_size, (1,), generator=generator))
        tokens = [token]
        table = self.next_tokens.tolist()
        for choice in choices:
            token = table[token][choice]
            tokens.append(token)
        sequence = torch.tensor(tokens)
        return {"input_ids": sequence[:-1], "labels": sequence[1:]}


def rank_loss_sum(module: L.LightningModule, loss: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's summed token loss, from ``model_loss``'s value and this rank's token count.

    With a counted loss (``causal_lm_loss``) the d9d strategy weighs each data-parallel rank's mean loss by its
    share of the batch's tokens, so that the mean over the ranks is the token mean of the whole batch: the value
    is ``rank's loss sum / mean tokens per rank``, and times that mean it is the sum again. With one rank (or
    any strategy without weighting, when every rank holds as many tokens) it is ``mean * tokens``. The mean
    is reduced on the device: no host synchronisation.
    """
    mean_tokens = module.trainer.strategy.reduce(tokens.float(), reduce_op="mean")
    return loss.detach() * mean_tokens


class Qwen3Pretraining(L.LightningModule):
    """Causal-LM pretraining. Nothing here is specific to the d9d strategy except building on ``meta`` and
    reading the validation loss as the strategy weighs it (``rank_loss_sum``)."""

    def __init__(
        self,
        config: Qwen3Config | Qwen3MoeConfig,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_steps: int = 100,
        master_weights: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "master_weights": master_weights,
            }
        )
        self.config = config
        self.model: Qwen3ForCausalLM | Qwen3MoeForCausalLM | None = None
        # Counts the tokens it averages over, so the strategy weighs padded microbatches and ranks by them.
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss
        # exp(token-mean loss) over every validation token of every data-parallel rank (not a mean of batch
        # perplexities); the strategy syncs it over the data-parallel ranks only.
        self.val_perplexity = CausalLMPerplexity()

    def configure_model(self) -> None:
        if self.model is None:
            # On meta: no memory is used until the strategy has sharded the model and initialises each shard.
            with torch.device("meta"):
                if isinstance(self.config, Qwen3MoeConfig):
                    self.model = Qwen3MoeForCausalLM(self.config)
                else:
                    self.model = Qwen3ForCausalLM(self.config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        # model_loss is causal_lm_loss(self.model(input_ids), labels), run through the schedule when pp > 1.
        loss = model_loss(self, self.model, model_inputs(batch), batch["labels"], self.loss_fn)
        # The mean over all ranks; no prog_bar: it would read the value back to the host on every step.
        self.log("train/loss", loss, sync_dist=True)
        if isinstance(self.model, Qwen3MoeForCausalLM):
            # Already in the gradient (the strategy scales it like the loss); logged, not added. Under pp: the
            # router losses of this rank's layers.
            router = self.model.router_loss()
            if router is not None:
                self.log("train/router_loss", router, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        assert self.model is not None
        loss = model_loss(self, self.model, model_inputs(batch), batch["labels"], self.loss_fn)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        tokens = causal_lm_loss.count(batch["labels"])
        self.val_perplexity.update(rank_loss_sum(self, loss, tokens), tokens)
        self.log("val/ppl", self.val_perplexity, prog_bar=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        hp = self.hparams
        optimizer: torch.optim.Optimizer
        if hp.get("master_weights", False):
            # bf16 parameters, fp32 masters in the optimizer (D9DStrategy(fsdp_on_one_rank=False), one device)
            optimizer = MasterWeightAdamW(
                self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95)
            )
        else:
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95), fused=True
            )

        def warmup_cosine(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintProgress(Callback):
    """One line every few steps, readable in a terminal or a CI log."""

    def __init__(self, every: int) -> None:
        self.every, self.start = every, time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:  # type: ignore[no-untyped-def]
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every == 0 and not should_accumulate(trainer):
            metrics = trainer.callback_metrics
            loss = metrics.get("train/loss")
            # Throughput's last window (absent until one closed; no MFU on CPU: no peak known there)
            speed = "".join(
                f"  {label} {float(metrics[key]):{spec}}"
                for key, label, spec in (
                    ("perf/tokens_per_sec", "tok/s", ".0f"),
                    ("perf/tflops_per_device", "TFLOP/s/dev", ".3g"),
                    ("perf/mfu", "MFU", ".1%"),
                    ("perf/max_memory_gib", "mem GiB", ".1f"),
                )
                if key in metrics
            )
            print(
                f"step {step:4d}  loss {float(loss):.4f}{speed}  {time.perf_counter() - self.start:6.1f}s",
                flush=True,
            )


MODELS = {"tiny-moe": Qwen3MoeConfig.tiny, "tiny": Qwen3Config.tiny, "0.6b": Qwen3Config.qwen3_0_6b}
# transformers' own model classes, each of the shape of one of our presets (the same hyperparameters)
TRANSFORMERS_MODELS = {"hf-qwen3": "tiny", "hf-qwen3-moe": "tiny-moe"}


class RouterAuxLoss:
    """A ``transformers`` MoE's training loss as ``transformers`` computes it when given labels:
    ``causal_lm_loss`` of the output's logits plus ``router_aux_loss_coef`` times its load-balancing loss
    (``output.aux_loss``, there when the config has ``output_router_logits``); counted as ``causal_lm_loss`` counts,
    so the strategy weighs microbatches and ranks by their tokens. The last load-balancing loss is kept in
    ``router_loss`` for logging."""

    def __init__(self, router_aux_loss_coef: float) -> None:
        self.router_aux_loss_coef = router_aux_loss_coef
        self.router_loss: torch.Tensor | None = None

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        aux = output.aux_loss
        self.router_loss = aux.detach()
        return causal_lm_loss(output.logits, labels) + self.router_aux_loss_coef * aux

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss.count(labels)


class TransformersPretraining(Qwen3Pretraining):
    """The same pretraining on ``transformers``' own model of ``config``'s shape (built from
    ``config.to_hf_dict()``), on ``meta``: the strategy gives it the plans its config ships and initialises it by
    ``transformers``' own rules. The loss is ``causal_lm_loss`` (it reads the output's ``.logits``; ``model_loss``
    fuses the head into it where it can, as for ours), for an MoE plus its router loss in training."""

    def __init__(self, config: Qwen3Config | Qwen3MoeConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        moe = isinstance(config, Qwen3MoeConfig) and config.output_router_logits
        self.router_aux_loss = RouterAuxLoss(config.router_aux_loss_coef) if moe else None

    def configure_model(self) -> None:
        if self.model is None:
            import transformers  # optional: only this model needs it

            values = self.config.to_hf_dict()
            hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(hf_config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.router_aux_loss is None:
            return super().training_step(batch, batch_idx)
        loss = model_loss(self, self.model, (batch["input_ids"],), batch["labels"], self.router_aux_loss)
        self.log("train/loss", loss, sync_dist=True)  # with the router loss, as transformers' own loss
        # the load-balancing loss before its coefficient
        self.log("train/router_loss", self.router_aux_loss.router_loss, sync_dist=True)
        return loss


def build_module(model: str, config: Qwen3Config | Qwen3MoeConfig, **kwargs: Any) -> Qwen3Pretraining:
    """The LightningModule for ``--model``: ours, or ``transformers``' model of the same shape."""
    module_class = TransformersPretraining if model in TRANSFORMERS_MODELS else Qwen3Pretraining
    return module_class(config, **kwargs)


def make_logger(kind: str, output: Path) -> Logger:
    """CSV (``metrics.csv``) or TensorBoard event files (through ``tensorboard`` or, if only that is installed,
    ``tensorboardX``, a dependency of lightning-d9d) under ``output/logs``."""
    if kind == "tensorboard":
        return TensorBoardLogger(output, name="logs")
    return CSVLogger(output, name="logs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=[*sorted(MODELS), *TRANSFORMERS_MODELS],
        default="tiny-moe",
        help="ours (tiny-moe, tiny, 0.6b) or transformers' model of a preset's shape (hf-qwen3: tiny's, "
        "hf-qwen3-moe: tiny-moe's)",
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--pipeline-schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--untied", action="store_true", help="untie embedding and head (needed for pp > 1)")
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1, help="tensor (+ sequence) parallel degree")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size (sequences per step)")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--output", type=Path, default=Path("runs/pretrain_qwen3"))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--expert-bias-rate",
        type=float,
        default=1e-3,
        help="MoE: step of the auxiliary-loss-free selection-bias update (0: no bias, expert load still logged)",
    )
    parser.add_argument("--logger", choices=["csv", "tensorboard"], default="csv", help="where metrics go")
    return parser.parse_args(argv)


def data_parallel_ranks(world: int, *, pp: int, dp_replicate: int, dp_shard: int, tp: int) -> int:
    """The ranks that each take ``batch_size / dp`` rows: ``dp_replicate x dp_shard``, where ``dp_shard=-1`` is what
    ``pp``, ``dp_replicate`` and ``tp`` leave of the world."""
    shard = world // (pp * dp_replicate * tp) if dp_shard == -1 else dp_shard
    return dp_replicate * shard


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    overrides: dict[str, object] = {"tie_word_embeddings": False} if args.untied else {}
    moe = args.model == "tiny-moe"
    if args.expert_bias_rate < 0:
        raise SystemExit(f"--expert-bias-rate ({args.expert_bias_rate}) must be >= 0 (0 turns the bias off)")
    if moe and args.expert_bias_rate > 0:
        overrides["router_selection_bias"] = True
    config = MODELS[TRANSFORMERS_MODELS.get(args.model, args.model)](**overrides)
    world = args.devices * args.num_nodes
    dp = data_parallel_ranks(
        world, pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp
    )
    if args.batch_size % (dp * args.accumulate):
        raise SystemExit(
            f"--batch-size ({args.batch_size}) must be divisible by dp*accumulate ({dp}*{args.accumulate})"
        )
    per_rank_batch = args.batch_size // (dp * args.accumulate)
    samples = args.batch_size * args.max_steps
    train = SyntheticCorpus(config.vocab_size, args.seq_len, samples)
    # Held-out samples of the same language.
    val = SyntheticCorpus(config.vocab_size, args.seq_len, 4 * per_rank_batch * dp, first_sample=samples)

    checkpoints = ModelCheckpoint(
        dirpath=args.output / "checkpoints", every_n_train_steps=max(1, args.max_steps // 2), save_last=True
    )
    trainer = L.Trainer(
        strategy=D9DStrategy(
            pp=args.pp,
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            tp=args.tp,
            pipeline_schedule=args.pipeline_schedule,
            microbatches=args.microbatches,
        ),
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        val_check_interval=max(1, args.max_steps // 2) * args.accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        logger=make_logger(args.logger, args.output),
        # GarbageCollection: Python's collector every 50 steps on every rank, not at random steps
        callbacks=[checkpoints, Throughput(window=10), PrintProgress(every=10), GarbageCollection()]
        # MoE: the bias update (with the rate) and the per-layer expert load in the logs.
        + ([ExpertLoadBalancing(args.expert_bias_rate)] if moe else []),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = build_module(args.model, config, lr=args.lr, max_steps=args.max_steps)
    trainer.fit(
        module,
        DataLoader(train, batch_size=per_rank_batch, num_workers=0),
        DataLoader(val, batch_size=per_rank_batch, num_workers=0),
    )
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {metrics}; the corpus entropy (best reachable loss) is {train.entropy():.4f}")
        print(f"mesh: {trainer.strategy.parallel_dims}")
        model = next(c for c in type(module.model).__mro__ if "fsdp" not in c.__module__)  # FSDP's class: no
        print(f"model: {model.__module__}.{model.__name__}")
        print(f"checkpoint: {checkpoints.last_model_path}")
        print(f"logs: {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
