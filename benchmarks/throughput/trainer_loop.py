"""The Trainer paths' harness (``ours_trainer*``, ``hf_trainer*``, the LoRA Trainer paths): the plain loops'
batches in a dataset, ``D9DStrategy`` with the options the path's name asks for, a callback that times the
measured window and runs the probes, ``trainer.fit`` of the path's module (``paths_ours`` / ``paths_baseline``),
and the result."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from .instruments import (
    GpuStall,
    SyncProbe,
    _batches,
    _device,
    _ms,
    _profiler,
    _summary,
    _sync,
    _write_profile,
)
from .paths import LORA_PATHS, _master_weights
from .paths_baseline import _hf_model, causal_lm_training
from .paths_lora import lora_config, start_fingerprint, transformers_start_into_
from .paths_ours import ours_pretraining
from .shapes import _config, _model_class


def run_trainer(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    import lightning_d9d
    from lightning_d9d.callbacks import GarbageCollection

    # The example next to the package that is imported (the working tree's, or a snapshot's).
    sys.path.insert(0, str(Path(lightning_d9d.__file__).resolve().parents[1] / "examples"))
    from pretrain_qwen3 import Qwen3Pretraining  # the example's LightningModule, unchanged

    device = _device(args)
    config = _config(args)
    # The strategy initialises the meta-built model from torch.initial_seed(): unseeded, every path started from
    # other weights (two runs of the same model differed by 0.02-0.03 in their first step's loss)
    torch.manual_seed(args.seed)
    total = args.warmup + args.steps
    probe = SyncProbe(device)
    inputs, labels = _batches(args, config.vocab_size, torch.device("cpu"))

    class FixedBatches(Dataset):
        """The plain loops' batches in their order, one sample at a time."""

        def __len__(self) -> int:
            return inputs.shape[0] * args.batch_size

        def __getitem__(self, index: int) -> dict[str, Any]:
            step, i = divmod(index, args.batch_size)
            return {"input_ids": inputs[step, i], "labels": labels[step, i]}

    class StepTimer(Callback):
        """Host clock between two synchronised step boundaries; per-step times from CUDA events."""

        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.t_fit = time.perf_counter()
            self.first_step_s: float | None = None
            self.warmup_s = 0.0
            self.warmup_peak: float | None = None
            self.sync_probe: dict[str, Any] | None = None
            self.ends: list[Any] = []
            self.losses: list[Any] = []
            self.profiler: Any = None
            self.start: dict[str, str] | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.losses.append(outputs["loss"].detach() if isinstance(outputs, dict) else outputs)
            if batch_idx == 0:
                _sync(device)
                self.first_step_s = time.perf_counter() - self.t_start
            if batch_idx == args.warmup - 1:
                _sync(device)
                self.t0 = time.perf_counter()
                self.warmup_s = self.t0 - self.t_start
                if device.type == "cuda":
                    self.warmup_peak = torch.cuda.max_memory_allocated(device) / 2**30
                    torch.cuda.reset_peak_memory_stats(device)
            if args.warmup - 1 <= batch_idx <= total - 1 and device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.ends.append(event)
            if batch_idx == total - 1:
                _sync(device)
                self.t1 = time.perf_counter()
                probe.start()  # the probe steps follow the measured window
            if self.profiler is not None and batch_idx == total + args.probe_steps + args.profile_steps - 1:
                _sync(device)
                self.profiler.__exit__(None, None, None)
                _write_profile(self.profiler, args, path)
                self.profiler = None

        def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            self.sync_probe = self.sync_probe or probe.stop()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if args.profile_steps and batch_idx == total + args.probe_steps:
                self.sync_probe = probe.stop()  # the profiled steps come after the probe's
                _sync(device)
                self.profiler = _profiler(device)
                self.profiler.__enter__()
            stall()

        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            if path in LORA_PATHS:  # the weights the first step starts from (the loss guard's premise)
                self.start = start_fingerprint(pl_module.named_parameters())
            _sync(device)
            self.t_start = time.perf_counter()
            self.setup_s = self.t_start - self.t_fit

    stall = GpuStall(device, args.gpu_stall_ms)
    timer = StepTimer()
    strategy = trainer_strategy(path)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=total + args.probe_steps + args.profile_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        # Lightning's DistributedSampler would shuffle the samples of FixedBatches: every batch would be drawn
        # from the four sequences with repeats, not be the plain loops' batch, and the loss guard would compare
        # different data (it did: +4-7 % after 16 steps on the H200 while the first three steps agreed).
        use_distributed_sampler=False,
        callbacks=[timer] + ([] if path.endswith("_autogc") else [GarbageCollection()]),
    )

    def our_model_on_meta() -> Any:
        with torch.device("meta"):
            return _model_class(config)(config)

    module: L.LightningModule
    if path.startswith("hf_trainer"):
        module = causal_lm_training(
            lambda: _hf_model(config, "meta"),
            lean=path.endswith("_lean"),
            master_weights=_master_weights(path),
            args=args,
            device=device,
        )
    elif path in LORA_PATHS:  # our model in the transformers paths' module: only the model differs
        # its base starts from transformers' weights, as the other LoRA paths' (our init_weights draws other
        # values), so that the loss guard compares like with like; the adapters start alike already
        module = causal_lm_training(
            our_model_on_meta,
            lean=False,
            master_weights=_master_weights(path),
            args=args,
            device=device,
            start=lambda model: transformers_start_into_(model, config, args.seed),
        )
    else:
        module = ours_pretraining(path, Qwen3Pretraining, config, args, device)
    trainer.fit(module, DataLoader(FixedBatches(), batch_size=args.batch_size, num_workers=0))
    model: Any = module.model  # the example's and CausalLMTraining's attribute
    assert model is not None
    result: dict[str, Any] = {
        "n_params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "setup_s": timer.setup_s,
        "peak_mem_warmup_gib": timer.warmup_peak,
        "first_step_s": timer.first_step_s,
        "warmup_s": timer.warmup_s,
        "elapsed_s": timer.t1 - timer.t0,
        "losses": [float(x) for x in timer.losses],
        "optimizer": repr(trainer.optimizers[0]).replace("\n", " "),
        "sync_probe": getattr(timer, "sync_probe", None),
    }
    if timer.start is not None:
        result["start"] = timer.start
    # Whether model_loss took the fused LM head + cross-entropy (no [tokens, vocab] logits): the strategy
    # announces it once per process (a private set: None where this version has none).
    announced = getattr(sys.modules.get("lightning_d9d.loss.head"), "_ANNOUNCED", None)
    result["fused_loss"] = None if announced is None else "fused" in announced
    # a named backend runs or refuses (the path then fails): the name is what ran
    result["attention_backend"] = os.environ.get("LIGHTNING_D9D_ATTENTION") or "auto"
    # which loss ran: causal_lm_loss itself, or the logits wrapper (CausalLMTraining's; the example's has its own)
    if not isinstance(module, Qwen3Pretraining):
        lean = path.endswith("_lean")
        result["loss_fn"] = (
            "causal_lm_loss on output.logits" if lean else repr(getattr(module, "loss_fn", None))
        )
    if len(timer.ends) > 1:
        result["step_ms"] = _summary([_ms(a, b) for a, b in itertools.pairwise(timer.ends)])
    return result


def trainer_strategy(path: str) -> Any:
    """The ``D9DStrategy`` a Trainer path's name asks for: ``compiled`` (``_autotune``: Inductor's GEMM autotuning,
    ``_cudagraphs``: CUDA graphs), ``nofsdp`` (no FSDP on the one rank), ``_reshard``, ``_selective`` / ``_full``
    (activation checkpointing), ``_fp8_<recipe>`` (``_bf16experts``: the experts in bf16), LoRA."""
    from lightning_d9d import D9DStrategy

    return D9DStrategy(
        compile=(
            "max-autotune-no-cudagraphs"
            if "autotune" in path
            else "reduce-overhead"
            if "cudagraphs" in path
            else True
        )
        if "compiled" in path
        else False,
        fsdp_on_one_rank="nofsdp" not in path,
        reshard_after_forward=True if path.endswith("_reshard") else None,
        activation_checkpointing=next((k for k in ("selective", "full") if path.endswith(f"_{k}")), False),
        fp8=next((recipe for recipe in ("tensorwise", "rowwise") if f"_fp8_{recipe}" in path), None),
        fp8_experts=False if path.endswith("_bf16experts") else None,
        lora=lora_config() if path in LORA_PATHS else None,
    )
