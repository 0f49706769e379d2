"""The torchtitan paths (``titan_compiled*``): torchtitan's own Qwen3 as its trainer builds it for one device
(its flavor of the shape, its float8 converter for the ``_fp8_`` paths, ``parallelize_qwen3``) and its own compiled
cross-entropy. Needs torchtitan 0.2.2 on the path (benchmarks/README.md)."""

from __future__ import annotations

import argparse
from typing import Any


def _titan_model(args: argparse.Namespace, config: Any, device: Any, path: str) -> tuple[Any, Any]:
    """torchtitan's Qwen3 as its trainer builds it for one device: its own flavor of the shape (``0.6B``,
    ``1.7B``, ``4B``, ``8B``; ``debugmodel`` for ``--model tiny``; for the MoE shapes its ``30B-A3B`` /
    ``debugmodel_moe`` flavor set to our shape, with its grouped-GEMM experts and no load-balancing bias, as ours
    has none), given our vocabulary so the batches fit; its float8 converter on the meta model for the ``_fp8_``
    paths (torchtitan's ``train.py`` order), then its ``parallelize_qwen3`` with compile on (per transformer
    block) and activation checkpointing off; no parallel degree is enabled, so no FSDP, and the plain loop
    autocasts to bf16 as torchtitan's ``maybe_enable_amp`` does on one device."""
    import dataclasses

    import torch
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims as TitanDims
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3, qwen3_args
    from torchtitan.protocols.model_converter import build_model_converters

    flavors = {
        "0.6b": "0.6B",
        "1.7b": "1.7B",
        "4b": "4B",
        "8b": "8B",
        "tiny": "debugmodel",
        "moe": "debugmodel_moe",
        "moe_large": "30B-A3B",
        "moe_tiny": "debugmodel_moe",
    }
    if args.model not in flavors:
        raise ValueError(f"{path} has no flavor for --model {args.model}; use one of {sorted(flavors)}")
    shape: dict[str, Any] = {"max_seq_len": args.seq_len, "vocab_size": config.vocab_size}
    if args.layers:
        shape["n_layers"] = args.layers
    base = qwen3_args[flavors[args.model]]
    if args.model in ("moe", "moe_large", "moe_tiny"):
        shape.update(
            dim=config.hidden_size,
            head_dim=config.head_dim,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            moe_inter_dim=config.moe_intermediate_size,
            enable_weight_tying=config.tie_word_embeddings,
            moe_args=dataclasses.replace(
                base.moe_args,
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                load_balance_coeff=None,
            ),
        )
    model_args = dataclasses.replace(base, **shape)
    job = JobConfig()
    job.training.seq_len = args.seq_len
    job.compile.enable = True
    job.compile.components = ["model"]
    job.activation_checkpoint.mode = "none"
    recipe = next((r for r in ("rowwise", "tensorwise") if path.endswith(f"_fp8_{r}")), None)
    if recipe is not None:
        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.recipe_name = recipe
        job.quantize.linear.float8.filter_fqns = ["output"]
    dims = TitanDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    build_model_converters(job, dims).convert(model)
    model = parallelize_qwen3(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    return model, model


def _titan_loss() -> Any:
    """torchtitan's cross-entropy as its trainer builds it with compile on (the default components, model and
    loss: an fp32 upcast and a sum, compiled), over the scored tokens as its trainer normalises on one rank."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.compile.enable = True
    job.compile.components = ["model", "loss"]
    summed = build_cross_entropy_loss(job)
    return lambda logits, labels: summed(logits, labels) / labels.numel()
