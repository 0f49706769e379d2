"""The single-process PyTorch loop that every Trainer run is compared with (no Lightning, no DTensor)."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from plain_module import build_plain_model
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus, model_inputs

from lightning_d9d.data import PackedDataset
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.moe import routers_in, update_expert_bias
from lightning_d9d.optim import Muon, StochasticAdamW, muon_param_groups
from lightning_d9d.plans.lora import LoRA, apply_lora


class PaddedCorpus(Dataset):
    """The corpus with the last ``5 * i mod (seq_len - 1)`` labels of sample ``i`` ignored (-100), so that
    samples, microbatches and ranks hold different numbers of scored tokens."""

    def __init__(self, corpus: SyntheticCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = dict(self.corpus[index])
        labels = item["labels"].clone()
        padding = (5 * index) % (labels.numel() - 1)
        if padding:
            labels[-padding:] = -100
        item["labels"] = labels
        return item


def packed_corpus(vocab_size: int, seq_len: int, rows: int, first_sample: int = 0) -> Dataset:
    """``rows`` packed rows of ``seq_len``: the corpus's sequences cut into documents of 2 to 40 tokens, packed in
    order (rows of several documents; a document that does not fit continues in the next row)."""
    generator = torch.Generator().manual_seed(5 + first_sample)
    source = SyntheticCorpus(vocab_size, 63, rows, first_sample=first_sample)
    documents = []
    for index in range(len(source)):
        sequence = torch.cat([source[index]["input_ids"][:1], source[index]["labels"]])
        start = 0
        while start < sequence.numel() - 1:
            length = int(torch.randint(2, 41, (1,), generator=generator))
            documents.append(sequence[start : start + length])
            start += length
    return Subset(PackedDataset(documents, seq_len), range(rows))


def train_corpus(config: dict, vocab_size: int) -> Dataset:
    """The training data of a run: ``config["pad"]`` pads it, ``config["packed"]`` packs documents instead."""
    if config.get("packed"):
        return packed_corpus(
            vocab_size, config["seq_len"], config["global_batch"] * config["steps_per_epoch"]
        )
    corpus = SyntheticCorpus(
        vocab_size, config["seq_len"], config["global_batch"] * config["steps_per_epoch"]
    )
    return PaddedCorpus(corpus) if config.get("pad") else corpus


def val_corpus(config: dict, vocab_size: int) -> Dataset:
    """The validation data of a run (two global batches, other samples than training's): ``config["pad"]``
    pads it too, so that a validation loss averaged over ranks instead of weighed by their tokens differs."""
    if config.get("packed"):
        return packed_corpus(vocab_size, config["seq_len"], config["global_batch"] * 2, first_sample=10_000)
    corpus = SyntheticCorpus(vocab_size, config["seq_len"], config["global_batch"] * 2, first_sample=10_000)
    return PaddedCorpus(corpus) if config.get("pad") else corpus


def uncounted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``causal_lm_loss`` as a plain function: the strategy cannot count its tokens and weighs microbatches and
    ranks equally (which equals the token mean when nothing is padded)."""
    return causal_lm_loss(logits, labels)


def exclude_experts(module: torch.nn.Module, experts: list[int]) -> None:
    """A selection bias of -1000 for ``experts`` in every router: no token chooses them (uneven expert loads,
    some experts with none), and a bias update of a few steps cannot bring them back."""
    for router in routers_in(module):
        assert router.expert_bias is not None, "exclude_experts needs routers with a selection bias"
        router.expert_bias[experts] = -1e3


def freeze(module: torch.nn.Module, parts: list[str]) -> None:
    """What a user freezing modules writes: ``requires_grad_(False)`` on the parameters named with one of ``parts``."""
    for name, param in module.named_parameters():
        if any(part in name for part in parts):
            param.requires_grad_(False)


def use_optimizer(module: torch.nn.Module, config: dict) -> None:
    """``config["optimizer"] == "sgd"``: plain SGD (no momentum, no weight decay) under the module's learning-rate
    schedule instead of AdamW, whose division by ``sqrt(v) + eps`` scales a near-zero gradient's rounding
    noise up to an lr-sized update. Parameters then differ from the reference's by the gradients' own
    differences times lr, which a tight tolerance can hold. ``"muon"``: :func:`_use_muon`."""
    if config.get("optimizer", "adamw") == "adamw":
        if "adamw_eps" in config:
            _set_adamw_eps(module, config["adamw_eps"])
        return
    if config["optimizer"] == "muon":
        _use_muon(module, config)
        return
    if config["optimizer"] == "stochastic_adamw":
        _use_stochastic_adamw(module, config)
        return
    assert config["optimizer"] == "sgd", config["optimizer"]
    configure = module.configure_optimizers

    def sgd():  # type: ignore[no-untyped-def]
        configured = configure()
        adamw = configured["optimizer"]
        optimizer = torch.optim.SGD(adamw.param_groups[0]["params"], lr=config["lr"])
        schedule = configured["lr_scheduler"]["scheduler"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = sgd  # type: ignore[method-assign]


def _use_muon(module: torch.nn.Module, config: dict) -> None:
    """``config["optimizer"] == "muon"``: what a user writes in ``configure_optimizers``,
    ``Muon(muon_param_groups(self.model), ...)``, under the module's learning-rate schedule. In the Trainer it runs
    after the strategy parallelized the model (DTensor parameters, FSDP's and the plans' names kept)."""
    configure = module.configure_optimizers

    def muon():  # type: ignore[no-untyped-def]
        schedule = configure()["lr_scheduler"]["scheduler"]
        model = module.model  # type: ignore[union-attr]
        optimizer = Muon(muon_param_groups(model), lr=config["lr"], weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = muon  # type: ignore[method-assign]


def _use_stochastic_adamw(module: torch.nn.Module, config: dict) -> None:
    """``config["optimizer"] == "stochastic_adamw"``: ``StochasticAdamW`` over the module's (bf16) parameters
    under its learning-rate schedule, rounding with ``config.get("rounding_seed", 0)``."""
    configure = module.configure_optimizers

    def stochastic():  # type: ignore[no-untyped-def]
        schedule = configure()["lr_scheduler"]["scheduler"]
        optimizer = StochasticAdamW(
            module.parameters(),
            lr=config["lr"],
            betas=(0.9, 0.95),
            weight_decay=0.1,
            seed=config.get("rounding_seed", 0),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = stochastic  # type: ignore[method-assign]


def _set_adamw_eps(module: torch.nn.Module, eps: float) -> None:
    """AdamW with a larger ``eps`` (``config["adamw_eps"]``): its update ``lr * m / (sqrt(v) + eps)`` moves by up to
    ``lr / eps`` per unit of a near-zero gradient's rounding (1e5 at lr 1e-3 and torch's 1e-8), so two runs whose
    gradients agree to the last bits may end within 1e-5 on one CPU and past it on another (seen: the same code
    within the band on earlier machines, 1.2e-5 off on an AMD EPYC with AVX2). At 1e-6 that factor is 1e3, and the
    optimizer is still AdamW over the same parameters."""
    configure = module.configure_optimizers

    def with_eps():  # type: ignore[no-untyped-def]
        configured = configure()
        for group in configured["optimizer"].param_groups:
            group["eps"] = eps
        return configured

    module.configure_optimizers = with_eps  # type: ignore[method-assign]


def _microbatches(config: dict) -> int:
    """How many forwards each rank's batch makes: the pipeline's microbatches under pp, else one."""
    dims = config.get("dims", {})
    return int(dims.get("microbatches", 1)) if dims.get("pp", 1) > 1 else 1


def _micro_step_weights(config: dict, window: list[dict], accumulate: int) -> list[torch.Tensor]:
    """What each micro-step's (mean) loss is multiplied by before backward. A counted loss: the micro-step's
    share of the tokens of the whole optimizer step, so that the step's gradient is the token mean of all its
    batches; ``uncounted_loss``: ``1 / accumulate`` each (Lightning's own division, also in a window cut
    short)."""
    if config.get("uncounted_loss"):
        return [torch.tensor(1.0 / accumulate)] * len(window)
    counts = [(batch["labels"] != -100).sum() for batch in window]
    total = torch.stack(counts).sum()
    return [count / total for count in counts]


def reference_run(config: dict) -> dict:
    """Train like the Trainer should: same init seed, same global batches, same optimizer and schedule."""
    seed, accumulate = config["seed"], config.get("accumulate", 1)
    torch.manual_seed(seed)
    model_config = Qwen3Config.tiny(**config.get("model", {}))
    module = Qwen3Pretraining(
        model_config, lr=config["lr"], warmup_steps=2, max_steps=config["schedule_steps"]
    )
    if config.get("plain_module"):
        module.model = build_plain_model(model_config.vocab_size, rank=0)  # type: ignore[assignment]
    elif config.get("moe") is not None:
        moe = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(**config["moe"]))
        # The router losses are each data-parallel rank's own (they are not linear in the batch), averaged
        # over the ranks like the gradients: run each rank's part of the global batch on its own.
        # Under pp each microbatch is a forward of its own (router losses per microbatch, scaled alike).
        moe.set_router_loss_scale(1 / (config["dp"] * accumulate * _microbatches(config)))
        if config.get("moe_balance"):
            exclude_experts(moe, config["moe_balance"]["unchosen"])
        module.model = moe  # type: ignore[assignment]
    else:
        module.model = Qwen3ForCausalLM(model_config)  # eager init, the meta-device path must match it
    if config.get("lora"):  # adapters initialised from the run's seed, as the strategy's are
        apply_lora(module, LoRA(**config["lora"]), seed=seed)
    if config.get("freeze"):
        freeze(module, config["freeze"])
    use_optimizer(module, config)
    precision = config.get("precision", "32-true")
    if precision == "bf16-true":
        module.model.to(torch.bfloat16)  # parameters, gradients and optimizer state in bf16
    compute_model = module.model
    # bf16-mixed without FSDP (one rank, fsdp_on_one_rank=False): the strategy autocasts the forward instead.
    autocast = precision == "bf16-mixed" and config.get("dims", {}).get("fsdp_on_one_rank") is False
    forward_context = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    )
    if precision == "bf16-mixed" and not autocast:
        # What FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does: compute with a bf16
        # copy of the fp32 parameters (buffers stay fp32), hand fp32 gradients to the fp32 parameters.
        compute_model = copy.deepcopy(module.model)
        for param in compute_model.parameters():
            param.data = param.data.to(torch.bfloat16)
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    global_batch = config["global_batch"]
    train = train_corpus(config, model_config.vocab_size)
    # One replica of Lightning's sampler: each global batch holds the same samples as the dp ranks' batches.
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    losses: list[float] = []
    grad_norms: list[float] = []
    step_grads: list[dict[str, torch.Tensor]] = []
    steps, epoch = 0, 0
    while steps < config["max_steps"]:
        sampler.set_epoch(epoch)
        batches = list(DataLoader(train, batch_size=global_batch, sampler=sampler))
        # Lightning's accumulation windows: `accumulate` batches, the last one of an epoch cut short
        for start in range(0, len(batches), accumulate):
            window = batches[start : start + accumulate]
            for batch, weight in zip(window, _micro_step_weights(config, window, accumulate), strict=True):
                if compute_model is not module.model:
                    with torch.no_grad():
                        for low, master in zip(
                            compute_model.parameters(), module.model.parameters(), strict=True
                        ):
                            low.copy_(master)
                if config.get("moe") is not None:  # rank r's batch is rows r, r + dp, ... of the global batch
                    dp, ids, labels = config["dp"], batch["input_ids"], batch["labels"]
                    chunks = _microbatches(config)
                    # the router losses weigh the micro-step as its loss does, split over the forwards
                    assert isinstance(compute_model, Qwen3MoeForCausalLM)
                    compute_model.set_router_loss_scale(float(weight) / (dp * chunks))
                    with forward_context():
                        parts = [
                            causal_lm_loss(compute_model(rows), row_labels)
                            for r in range(dp)
                            for rows, row_labels in zip(
                                ids[r::dp].tensor_split(chunks),
                                labels[r::dp].tensor_split(chunks),
                                strict=True,
                            )
                        ]
                    loss = torch.stack(parts).mean()  # unpadded: the global token mean
                else:
                    with forward_context():
                        loss = causal_lm_loss(compute_model(*model_inputs(batch)), batch["labels"])
                losses.append(loss.item())
                (loss * weight).backward()
                if compute_model is not module.model:
                    for low, master in zip(
                        compute_model.parameters(), module.model.parameters(), strict=True
                    ):
                        assert low.grad is not None
                        grad = low.grad.float()
                        master.grad = grad if master.grad is None else master.grad + grad
                        low.grad = None
            if config.get("record_grads"):  # every step's gradients, before clipping
                step_grads.append(
                    {
                        n: p.grad.detach().float().clone()
                        for n, p in module.named_parameters()
                        if p.grad is not None
                    }
                )
            params = list(module.parameters())
            if config.get("clip"):
                norm = torch.nn.utils.clip_grad_norm_(params, config["clip"])
            else:
                norm = torch.nn.utils.get_total_norm([p.grad.float() for p in params if p.grad is not None])
            grad_norms.append(float(norm))  # before clipping
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if config.get("moe_balance"):  # every rank's load of the whole step, summed
                update_expert_bias(routers_in(module.model), config["moe_balance"]["rate"])
            steps += 1
            if steps == config["max_steps"]:
                break
        epoch += 1
    result: dict = {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }
    if config.get("record_grads"):
        result["step_grads"] = step_grads
    if config.get("validate"):
        val = val_corpus(config, model_config.vocab_size)
        with torch.no_grad():
            val_losses = [
                causal_lm_loss(module.model(*model_inputs(b)), b["labels"]).item()
                for b in DataLoader(val, batch_size=global_batch)
            ]
        result["val_loss"] = sum(val_losses) / len(val_losses)
    return result
