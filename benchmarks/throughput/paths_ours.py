"""Our model's paths (``ours_*``): lightning_d9d's Qwen3 (or Qwen3-MoE) on the plain loops (eager, the product's
per-block compile, whole-model compile, or parallelized as the strategy does on one rank, FSDP2 with or without
the plan's compile), and the example's LightningModule the ``ours_trainer*`` paths train (``Qwen3Pretraining`` of
``examples/pretrain_qwen3.py``, or its lean diagnostic variant)."""

from __future__ import annotations

import argparse
from typing import Any

from .paths import _master_weights
from .shapes import _model_class


def ours_plain_loop_model(path: str, args: argparse.Namespace, config: Any, device: Any) -> tuple[Any, Any]:
    """An ``ours_*`` plain-loop path's model and its callable ``inputs -> logits`` (the model itself)."""
    import torch

    model_class = _model_class(config)

    if path in ("ours_fsdp_loop", "ours_fsdp_compiled"):
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from lightning_d9d import ParallelDims, ParallelOptions

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        dims = ParallelDims().resolve(1).build_mesh(device.type)
        with torch.device("meta"):
            model = model_class(config)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model.parallelize(dims, ParallelOptions(mp_policy=policy, compile=path == "ours_fsdp_compiled"))
        model.to_empty(device=device)
        model.init_weights(args.seed)
        model.train()
        return model, model

    with torch.device(device):
        model = model_class(config)
    model.train()
    if path == "ours_compiled":
        from lightning_d9d.plans import apply_compile

        apply_compile(model.model.layers)
        return model, model
    if path == "ours_compiled_model":
        return model, torch.compile(model)
    return model, model


def ours_pretraining(path: str, pretraining: Any, config: Any, args: argparse.Namespace, device: Any) -> Any:
    """The module an ``ours_trainer*`` path trains: the example's ``pretraining`` class (``Qwen3Pretraining``,
    unchanged) or, for the ``_lean`` paths, ``LeanPretraining``; at the plain loops' learning rate, constant."""
    from lightning_d9d.modules.loss import causal_lm_loss

    class LeanPretraining(pretraining):
        """Diagnostic variant: fused AdamW, and the loss logged without ``prog_bar`` (which ``.item()``s it)."""

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            assert self.model is not None
            loss = causal_lm_loss(self.model(batch["input_ids"]), batch["labels"])
            self.log("train/loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            out = super().configure_optimizers()
            for group in out["optimizer"].param_groups:
                group["foreach"], group["fused"] = False, device.type == "cuda"
            return out

    module_cls = LeanPretraining if path.endswith("_lean") else pretraining
    # The plain loops' constant learning rate (no warm-up, a cosine over 10^9 steps), so that the loss guard
    # compares runs that took the same optimizer steps; the schedule costs nothing measurable either way.
    return module_cls(
        config, lr=args.lr, warmup_steps=0, max_steps=10**9, master_weights=_master_weights(path)
    )
