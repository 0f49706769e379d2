"""Single-GPU training throughput of one Qwen3 shape through several code paths, measured in one run.

Every path trains the same model shape on the same batches (one per step) and runs in its own subprocess (so
compile caches, allocator state and peak memory do not leak between paths; each also gets its own empty
inductor/triton cache directory unless ``--shared-compile-cache``):

    hf_eager               transformers.Qwen3ForCausalLM (sdpa), plain PyTorch loop      <- the baseline
    hf_compiled            the same, torch.compile(model) (whole model)
    ours_eager             lightning_d9d.models.Qwen3ForCausalLM, the same plain loop
    ours_compiled          ours, per-block compile (lightning_d9d.plans.apply_compile, the product's compile)
    ours_compiled_model    ours, torch.compile(model) (whole model, like hf_compiled)
    ours_fsdp_loop         ours, parallelized as the strategy does on one rank (FSDP2 + MixedPrecisionPolicy),
                           in the plain loop: isolates FSDP2 from Lightning
    ours_trainer           Trainer(strategy="d9d", precision="bf16-mixed") on examples/pretrain_qwen3.py's
                           Qwen3Pretraining (the product path, unchanged module)
    ours_trainer_compiled  the same with D9DStrategy(compile=True)
    hf_trainer_compiled    transformers.Qwen3ForCausalLM (sdpa) as a user brings it: a LightningModule that builds
                           it on meta in configure_model, under Trainer(strategy=D9DStrategy(compile=True),
                           precision="bf16-mixed"); the strategy applies the transformers adapter's plan
                           (lightning_d9d.models.hf: compile and FSDP2 per decoder layer) and initialises it by
                           transformers' own rules; the loss through lightning_d9d.model_loss(..., causal_lm_loss);
                           fused AdamW, the loss logged without ``prog_bar`` (--model moe: Qwen3MoeForCausalLM)

Diagnostic paths (not in the default list; name them in ``--paths``):

    ours_fsdp_compiled          ours_fsdp_loop with the plan's per-block compile (ParallelOptions(compile=True))
    ours_trainer_lean           ours_trainer with a subclass of the example's module: fused AdamW, and the loss
                                logged without ``prog_bar`` (Lightning ``.item()``s progress-bar metrics each step);
                                its loss is ``causal_lm_loss`` on the logits outside ``model_loss`` (no fused LM
                                head + loss: the example itself has fused AdamW and no ``prog_bar`` by now)
    ours_trainer_compiled_lean  the same with D9DStrategy(compile=True)
    hf_trainer                  hf_trainer_compiled without compile
    hf_trainer_compiled_lean    hf_trainer_compiled with the loss on ``output.logits`` outside ``model_loss``, as
                                the lean module scores ours (always the logits path: no fused LM head + loss)

LoRA paths (run by ``benchmarks/lora_throughput.py``, which counts their FLOPs with the frozen weights apart;
this script refuses them): every one trains the same adapters (``lora_config``: rank 16, alpha 32, no dropout, on
every projection of the decoder blocks), the base frozen in bf16, the adapters in fp32:

    peft_fsdp_compiled               the baseline: transformers' model built in bf16, peft's ``get_peft_model``,
                                     then hf_fsdp_compiled's per-layer compile and FSDP2, fused AdamW over the
                                     adapters, the loss on the logits
    hf_trainer_lora_compiled_nofsdp  the same transformers model built on meta under
                                     ``D9DStrategy(lora=lora_config(), compile=True, fsdp_on_one_rank=False)``
                                     in hf_trainer's module (the loss through ``model_loss``: the fused LM head)
    ours_trainer_lora_compiled_nofsdp  our Qwen3ForCausalLM in that module, under the same strategy

All three start from the weights the strategy gives the transformers model (random: transformers' rules drawn from
the seed and each module's name; ``_peft_model`` and ``transformers_start_into_`` give them to the other two), the
adapters as the LoRA plan starts them; ``start`` in a path's result holds digests of them (``start_fingerprint``).

Precision recipe (the same for every plain loop): fp32 master weights, ``torch.autocast(bfloat16)`` around
forward + loss, fused AdamW (``fused=True`` on CUDA). The strategy's ``bf16-mixed`` instead casts the fp32
master weights to bf16 through FSDP2's ``MixedPrecisionPolicy`` (no autocast), so its residual stream is
bf16 where autocast keeps it in fp32; ``ours_fsdp_loop`` measures that recipe without Lightning. The loss is
always ``lightning_d9d.modules.loss.causal_lm_loss`` on the logits (eager, outside any compiled region).

Timing: ``--warmup`` steps (compilation included) then ``--steps`` measured steps between two
``torch.cuda.synchronize()`` calls; no host sync inside the window (per-step times come from CUDA events).
MFU = ``num_flops_per_token(seq_len) * tokens/s / peak`` with ``Qwen3ForCausalLM.num_flops_per_token``
(``6*N + 12*L*H*head_dim*T``) and ``--peak-tflops`` (989, the H100/H200 SXM dense bf16 datasheet number).
After the window, ``--probe-steps`` more steps run under ``torch.cuda.set_sync_debug_mode("warn")`` to count
host<->device synchronisations per step and where they come from (``sync_probe`` in the JSON).

Run (on a GPU machine, from the repository root):

    PYTHONPATH=. python benchmarks/train_throughput.py --out runs/bench            # all paths, GPU 0
    PYTHONPATH=. python benchmarks/train_throughput.py --gpus 0,1 --out runs/bench  # spread paths over 2 GPUs
    PYTHONPATH=. python benchmarks/train_throughput.py --device cpu --model tiny --seq-len 64 \
        --batch-size 2 --warmup 2 --steps 3 --paths hf_eager,ours_eager                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

PATHS: dict[str, str] = {
    "hf_eager": "HF transformers Qwen3ForCausalLM (sdpa), eager, plain loop",
    "hf_compiled": "HF, torch.compile(whole model), plain loop",
    "hf_fsdp_compiled": "HF, FSDP2 bf16 MixedPrecisionPolicy on 1 rank + torch.compile per decoder layer, plain loop",
    "ours_eager": "lightning_d9d Qwen3ForCausalLM, eager, plain loop",
    "ours_compiled": "ours, per-block compile (plans.apply_compile), plain loop",
    "ours_compiled_model": "ours, torch.compile(whole model), plain loop",
    "ours_fsdp_loop": "ours, FSDP2 bf16 MixedPrecisionPolicy on 1 rank (as the strategy), plain loop",
    "ours_fsdp_compiled": "ours_fsdp_loop with the plan's per-block compile (ParallelOptions(compile=True))",
    "ours_trainer": 'Trainer(strategy="d9d", bf16-mixed), examples Qwen3Pretraining',
    "ours_trainer_compiled": "the same with D9DStrategy(compile=True)",
    # Diagnostics: the example's module with fused AdamW and its loss logged without prog_bar (no .item()).
    "ours_trainer_lean": "ours_trainer, module with fused AdamW and self.log(..., prog_bar=False)",
    "ours_trainer_compiled_lean": "ours_trainer_compiled, the same lean module",
    # transformers' model under the Trainer (issue 24): the strategy picks the transformers adapter's plan.
    "hf_trainer": "HF Qwen3ForCausalLM built on meta, Trainer(strategy=D9DStrategy(), bf16-mixed), fused AdamW",
    "hf_trainer_compiled": "hf_trainer with D9DStrategy(compile=True) (the adapter compiles per decoder layer)",
    "hf_trainer_compiled_lean": "hf_trainer_compiled, the loss on output.logits outside model_loss (as *_lean)",
    # The strategy's levers on one GPU (docs/benchmarks.md): no FSDP on the one-rank mesh (bf16 autocast),
    # selective activation checkpointing (matmul and attention outputs kept, element-wise ops recomputed).
    "ours_trainer_compiled_nofsdp": "ours_trainer_compiled with D9DStrategy(fsdp_on_one_rank=False)",
    "hf_trainer_compiled_nofsdp": "hf_trainer_compiled with D9DStrategy(fsdp_on_one_rank=False)",
    # --model moe: the adapter's experts forward without ep (transformers' own, compiled over fp32 weights, loops
    # over the experts on the host), replayed as CUDA graphs
    "hf_trainer_compiled_nofsdp_cudagraphs": 'hf_trainer_compiled_nofsdp with compile="reduce-overhead"',
    # the configuration of our model's best MoE step (session 28), for the adapter against it in one run
    "hf_trainer_compiled_nofsdp_master": "hf_trainer_compiled_nofsdp with MasterWeightAdamW (bf16 parameters, fp32"
    " masters in the optimizer)",
    "ours_trainer_compiled_selective": 'ours_trainer_compiled with activation_checkpointing="selective"',
    "ours_trainer_compiled_nofsdp_selective": "both of the above",
    "ours_trainer_compiled_full": 'ours_trainer_compiled with activation_checkpointing="full" (every block)',
    # FSDP on one rank keeps each block's gathered (bf16) parameters to backward by default; this path frees
    # them after forward (as FSDP does where parameters are sharded): memory against speed.
    "ours_trainer_compiled_reshard": "ours_trainer_compiled with reshard_after_forward=True",
    # compile="max-autotune-no-cudagraphs": Inductor benchmarks Triton GEMM templates against cuBLAS per shape
    "ours_trainer_compiled_autotune": 'ours_trainer_compiled with compile="max-autotune-no-cudagraphs"',
    "ours_trainer_compiled_nofsdp_autotune": "the same without FSDP on the one rank",
    # The Trainer paths run the example's GarbageCollection callback (collector every 50 steps, as the example);
    # this one leaves Python's automatic collector on, to measure that lever.
    "ours_trainer_compiled_nofsdp_autogc": "ours_trainer_compiled_nofsdp without the GarbageCollection callback",
    # FP8 training of the decoder blocks' linear layers through torchao (issue 25): D9DStrategy(fp8=...). Under
    # --model moe the grouped experts' GEMMs too (float8 rowwise under either recipe, torchao's grouped GEMM, on
    # compute capability 9.0+: fp8_experts=None, which these paths pass); the _bf16experts path keeps them bf16.
    "ours_trainer_compiled_fp8_tensorwise": 'ours_trainer_compiled with fp8="tensorwise" (float8 FSDP all-gather;'
    " --model moe: experts rowwise)",
    "ours_trainer_compiled_fp8_rowwise": 'ours_trainer_compiled with fp8="rowwise" (--model moe: the experts too)',
    "ours_trainer_compiled_nofsdp_fp8_tensorwise": 'ours_trainer_compiled_nofsdp with fp8="tensorwise" (--model moe:'
    " experts rowwise)",
    "ours_trainer_compiled_nofsdp_fp8_rowwise": 'ours_trainer_compiled_nofsdp with fp8="rowwise" (--model moe: the'
    " grouped experts' GEMMs in float8 too)",
    "ours_trainer_compiled_nofsdp_fp8_rowwise_bf16experts": "ours_trainer_compiled_nofsdp_fp8_rowwise with"
    " fp8_experts=False (--model moe: the experts in bf16, the linears in float8)",
    # The strongest peer: torchtitan's own Qwen3 through its own parallelize_qwen3 on one device (its
    # single-device path: no FSDP, bf16 autocast, per-block compile; activation checkpointing off, as ours).
    # Needs torchtitan 0.2.2 and its pure-Python dependencies on the path (benchmarks/README.md).
    "titan_compiled": "torchtitan 0.2.2 Qwen3 (its flavor of the shape), parallelize_qwen3 on 1 device, plain loop",
    # torchtitan's FP8: its own float8 converter (torchao, recipe by name; the LM head "output" filtered out, as
    # ours leaves the head in bf16) applied before parallelize_qwen3, as its trainer does.
    "titan_compiled_fp8_rowwise": 'titan_compiled with its converter "quantize.linear.float8", recipe rowwise',
    "titan_compiled_fp8_tensorwise": 'titan_compiled with its converter "quantize.linear.float8", recipe tensorwise',
    # CUDA graphs (issue 25): compile="reduce-overhead" (Inductor's CUDA graph trees around each compiled block);
    # without FSDP on the one rank, whose per-step all-gathers would give the blocks new parameter addresses.
    "ours_trainer_compiled_nofsdp_cudagraphs": 'ours_trainer_compiled_nofsdp with compile="reduce-overhead"',
    "ours_trainer_compiled_nofsdp_master": "ours_trainer_compiled_nofsdp with MasterWeightAdamW: bf16 parameters,"
    " fp32 master weights in the optimizer",
    # the MoE step's routing waits on the host (session 27's profile): graphs replay its many small launches
    "ours_trainer_compiled_nofsdp_cudagraphs_master": "ours_trainer_compiled_nofsdp_master with"
    ' compile="reduce-overhead"',
    # FlashAttention 4 (issue 25): the attention backend forced by LIGHTNING_D9D_ATTENTION=flash_attn4 in the
    # worker (refused, so the path fails, where flash_attn.cute cannot run); the pair to measure against cuDNN
    "ours_trainer_compiled_fa4": "ours_trainer_compiled with the flash_attn4 attention backend (FlashAttention 4)",
    "ours_trainer_compiled_nofsdp_fa4": "ours_trainer_compiled_nofsdp with the flash_attn4 attention backend",
    # auto takes FA4 where it is installed (since 2026-12-05), so the cuDNN side of the pair is forced by name
    "ours_trainer_compiled_nofsdp_cudnn": "ours_trainer_compiled_nofsdp with the sdpa_cudnn attention backend",
    # the MoE shape's best path (master weights) with each attention by name: FA4 against cuDNN in one run
    "ours_trainer_compiled_nofsdp_master_cudnn": "ours_trainer_compiled_nofsdp_master with the sdpa_cudnn"
    " attention backend",
    "ours_trainer_compiled_nofsdp_master_fa4": "ours_trainer_compiled_nofsdp_master with the flash_attn4 attention"
    " backend",
    "hf_trainer_compiled_nofsdp_master_fa4": "hf_trainer_compiled_nofsdp_master with the flash_attn4 attention"
    " backend (the adapter routes transformers' attention to ours)",
    # FA4 launched from graphs, not through the CuTe DSL's Python runtime: session 32 (H100, MoE shape) 1.004x the
    # same without graphs, so the GPU's waits before FA4's forward kernel were not the host's launch cost
    "ours_trainer_compiled_nofsdp_cudagraphs_master_fa4": "ours_trainer_compiled_nofsdp_cudagraphs_master with"
    " the flash_attn4 attention backend",
}
# LoRA fine-tuning (benchmarks/lora_throughput.py runs these: the MFU of a frozen base counts 4 FLOPs per weight)
LORA_PATHS: dict[str, str] = {
    "peft_fsdp_compiled": "HF Qwen3ForCausalLM in bf16 + peft LoRA, FSDP2 bf16 MixedPrecisionPolicy on 1 rank +"
    " torch.compile per decoder layer, fused AdamW over the adapters, plain loop (the LoRA baseline)",
    "hf_trainer_lora_compiled_nofsdp": "hf_trainer_compiled_nofsdp with D9DStrategy(lora=lora_config()), fused"
    " AdamW over the adapters",
    "ours_trainer_lora_compiled_nofsdp": "our Qwen3ForCausalLM in hf_trainer_lora_compiled_nofsdp's module and"
    " strategy",
    # the memory lever, if the fastest path does not fit: selective activation checkpointing
    "hf_trainer_lora_compiled_nofsdp_selective": "hf_trainer_lora_compiled_nofsdp with activation_checkpointing="
    '"selective"',
}
#: The plain loops whose FSDP2 MixedPrecisionPolicy casts the parameters (every other plain loop autocasts).
FSDP_LOOPS = ("ours_fsdp_loop", "ours_fsdp_compiled", "hf_fsdp_compiled", "peft_fsdp_compiled")
#: The attention backend a path forces in its worker (LIGHTNING_D9D_ATTENTION), by the path's suffix.
ATTENTION_SUFFIXES = {"_fa4": "flash_attn4", "_cudnn": "sdpa_cudnn"}
DEFAULT_PATHS = [
    p
    for p in PATHS
    if p
    not in (
        "ours_fsdp_compiled",
        "ours_trainer_lean",
        "ours_trainer_compiled_lean",
        "hf_trainer",
        "hf_trainer_compiled_lean",
        "hf_fsdp_compiled",
        "ours_trainer_compiled_nofsdp",
        "hf_trainer_compiled_nofsdp",
        "hf_trainer_compiled_nofsdp_cudagraphs",
        "hf_trainer_compiled_nofsdp_master",
        "ours_trainer_compiled_selective",
        "ours_trainer_compiled_nofsdp_selective",
        "ours_trainer_compiled_full",
        "ours_trainer_compiled_reshard",
        "ours_trainer_compiled_autotune",
        "ours_trainer_compiled_nofsdp_autotune",
        "ours_trainer_compiled_nofsdp_autogc",
        "titan_compiled",
        "titan_compiled_fp8_rowwise",
        "titan_compiled_fp8_tensorwise",
        "ours_trainer_compiled_nofsdp_cudagraphs",
        "ours_trainer_compiled_nofsdp_master",
        "ours_trainer_compiled_nofsdp_cudagraphs_master",
        "ours_trainer_compiled_fp8_tensorwise",
        "ours_trainer_compiled_fp8_rowwise",
        "ours_trainer_compiled_nofsdp_fp8_tensorwise",
        "ours_trainer_compiled_nofsdp_fp8_rowwise",
        "ours_trainer_compiled_nofsdp_fp8_rowwise_bf16experts",
        "ours_trainer_compiled_fa4",
        "ours_trainer_compiled_nofsdp_fa4",
        "ours_trainer_compiled_nofsdp_cudnn",
        "ours_trainer_compiled_nofsdp_master_cudnn",
        "ours_trainer_compiled_nofsdp_master_fa4",
        "hf_trainer_compiled_nofsdp_master_fa4",
        "ours_trainer_compiled_nofsdp_cudagraphs_master_fa4",
    )
]
# --model moe: the MoE comparison (transformers' Qwen3-MoE, FSDP2 + per-layer compile, against the Trainer)
MOE_PATHS = ["hf_fsdp_compiled", "ours_trainer_compiled", "hf_trainer_compiled"]
BASELINES = ("hf_eager", "hf_compiled", "hf_fsdp_compiled", "titan_compiled", "peft_fsdp_compiled")
#: The baselines the first table compares every path with (a column each, ratios of median steps).
RATIO_COLUMNS = ("hf_eager", "hf_compiled", "hf_fsdp_compiled")
TITAN_PATHS = ("titan_compiled", "titan_compiled_fp8_rowwise", "titan_compiled_fp8_tensorwise")


# ===================================================================================================== worker
def _device(args: argparse.Namespace) -> Any:
    import torch

    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(args: argparse.Namespace) -> Any:
    from lightning_d9d.models import Qwen3Config

    layers = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.model in ("moe", "moe_tiny", "moe_large"):
        return _moe_config(args.model, **layers)
    if args.model in QWEN3_SHAPES:
        return Qwen3Config.qwen3_0_6b(**{**QWEN3_SHAPES[args.model], **layers})
    return Qwen3Config.qwen3_0_6b(**layers) if args.model == "0.6b" else Qwen3Config.tiny(**layers)


# Qwen3's released dense shapes beyond 0.6B (their config.json: hidden, MLP width, layers, heads; head_dim 128,
# 8 key-value heads, tied embeddings, vocabulary 151,936 as 0.6B)
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
    },
    "4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
}


def _moe_config(model: str, **overrides: Any) -> Any:
    """The MoE shape: 16 layers, hidden 1024, Qwen3 attention (16 heads, 8 KV heads, head_dim 128), 64 experts
    of width 384, top-8 (renormalised, as Qwen3-MoE), every layer sparse, Qwen3's vocabulary. Router losses
    off on both sides (the HF plain loop computes only the LM loss). ``moe_large``: Qwen3-30B-A3B's layer
    (hidden 2048, 32 heads, 4 KV heads, 128 experts of 768, top-8, untied head) at 6 layers, what fits one
    H200 with fp32 AdamW state (``--layers`` changes it). ``moe_tiny``: the CPU smoke shape."""
    from lightning_d9d.models import Qwen3MoeConfig

    if model == "moe_tiny":
        return Qwen3MoeConfig.tiny(output_router_logits=False, mlp_only_layers=[], **overrides)
    if model == "moe_large":
        return Qwen3MoeConfig(
            **{
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 6144,
                "num_hidden_layers": 6,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "norm_topk_prob": True,
                "output_router_logits": False,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
                **overrides,
            }
        )
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        output_router_logits=False,
        rope_theta=1e6,
    )


def _model_class(config: Any) -> Any:
    from lightning_d9d.models import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM


def _batches(args: argparse.Namespace, vocab: int, device: Any) -> tuple[Any, Any]:
    """Every step's batch: ``inputs [S, B, T]`` and next-token ``labels [S, B, T]`` for S = all steps run.

    Tokens are drawn independently from one fixed Zipf-like distribution over the vocabulary (weight
    ``1 / (rank + 10)``, ranks a seeded permutation), a fresh batch each step. A model learns that
    distribution smoothly (from ln(vocab) towards its entropy), so runs whose numerics differ only by bf16
    rounding end within a fraction of a percent of each other, while a run that does not train stays near
    ln(vocab). One fixed batch repeated (this benchmark's earlier data) is memorised chaotically: paths with
    identical numerics ended 2-3.5 % apart after 25 steps on the H200, and the guard could not tell noise
    from a defect.
    """
    import torch

    generator = torch.Generator().manual_seed(1234)
    ranks = torch.randperm(vocab, generator=generator)
    weights = torch.empty(vocab)
    weights[ranks] = 1.0 / (torch.arange(vocab, dtype=torch.float32) + 10.0)
    steps = args.warmup + args.steps + args.probe_steps + args.profile_steps
    ids = torch.multinomial(weights, steps * args.batch_size * (args.seq_len + 1), True, generator=generator)
    ids = ids.view(steps, args.batch_size, args.seq_len + 1)
    return ids[..., :-1].contiguous().to(device), ids[..., 1:].contiguous().to(device)


class _Events:
    """CUDA events recorded without host syncs; read once the window has been synchronised."""

    def __init__(self, device: Any) -> None:
        self.enabled = device.type == "cuda"
        self.marks: list[dict[str, Any]] = []

    def mark(self, step: dict[str, Any], name: str) -> None:
        import torch

        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            step[name] = event


def _ms(a: Any, b: Any) -> float:
    return float(a.elapsed_time(b))


class GpuStall:
    """``--gpu-stall-ms``: a spin kernel of that many GPU milliseconds queued at the start of every step.

    The host-bound probe: where the host runs ahead of the GPU (launches queued before the GPU needs them) a
    step grows by the whole stall; where the GPU waits for the host, the stall fills that wait first, so the
    step grows by less. ``stall - growth`` of the median step is the GPU's idle time per step (up to the stall).
    """

    def __init__(self, device: Any, ms: float) -> None:
        import torch

        self.cycles = 0
        if ms <= 0 or device.type != "cuda":
            return
        calibration = 20_000_000
        torch.cuda._sleep(calibration)  # first launch outside the timing
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(calibration)
        stop.record()
        torch.cuda.synchronize(device)
        self.cycles = int(calibration * ms / start.elapsed_time(stop))

    def __call__(self) -> None:
        import torch

        if self.cycles:
            torch.cuda._sleep(self.cycles)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


class SyncProbe:
    """Counts host<->device synchronisations (``torch.cuda.set_sync_debug_mode("warn")``) over a few extra
    steps after the measured window, and where in the Python code they were issued.

    Syncs inside calls that release the GIL without a Python warning handler (``torch.distributed`` ops, such
    as the NCCL ``barrier``) are printed by C++ instead; the parent counts those lines between the markers
    this probe prints (``native_syncs``).
    """

    START, END = "SYNC-PROBE-START", "SYNC-PROBE-END"

    def __init__(self, device: Any) -> None:
        self.enabled = device.type == "cuda"
        self.records: list[Any] = []
        self._catcher: Any = None
        self._markers = False
        # The first switch of the debug mode reports one sync of its own: spend it here.
        self.start()
        self.stop()
        self._markers = True

    def start(self) -> None:
        import warnings

        import torch

        if not self.enabled or self._catcher is not None:
            return
        self._catcher = warnings.catch_warnings(record=True)
        self.records = self._catcher.__enter__()
        warnings.simplefilter("always")
        if self._markers:
            sys.stderr.flush()
            print(self.START, flush=True)
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> dict[str, Any] | None:
        import torch

        if not self.enabled or self._catcher is None:
            return None
        torch.cuda.set_sync_debug_mode("default")
        if self._markers:
            sys.stderr.flush()
            print(self.END, flush=True)
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        syncs = [w for w in self.records if "synchroniz" in str(w.message)]
        where: dict[str, int] = {}
        for w in syncs:
            key = f"{w.filename}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
        return {"syncs": len(syncs), "where": where}


def _profiler(device: Any) -> Any:
    """``--profile-steps``' profiler: the host's ops with their operands' shapes (which GEMMs are the adapters'),
    and the device's kernels."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


def _write_profile(profile: Any, args: argparse.Namespace, path: str) -> None:
    """``--profile-steps``: where the step goes by kind of kernel (GEMMs of the blocks, the adapters and the LM
    head, attention, the loss, element-wise, the optimizer: ``profile_step.step_breakdown``), where the GPU waited,
    and the kernel table, as ``profile_<path>.txt`` in ``--out``."""
    from gpu_gaps import profile_report
    from profile_step import step_breakdown

    rank = LORA_RANK if path in LORA_PATHS else None
    try:  # a diagnostic: the path's measurement stands without it
        kinds = step_breakdown(profile, args.profile_steps, rank=rank, vocab=_config(args).vocab_size)
    except Exception as error:
        kinds = f"kernel kinds not available: {type(error).__name__}: {error}\n"
    text = f"{path}, {args.profile_steps} profiled steps\n\n{kinds}\n" + profile_report(
        profile, args.profile_steps, rows=40
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{path}.txt").write_text(text)
    print(text, flush=True)


def build_model(path: str, args: argparse.Namespace, device: Any) -> tuple[Any, Any]:
    """The module to train and the callable ``inputs -> logits``."""
    import torch

    config = _config(args)
    torch.manual_seed(args.seed)
    if path == "peft_fsdp_compiled":
        model = _peft_model(config, device, args.seed)
        return model, _hf_fsdp_compiled(model, device, model.get_base_model().model.layers)
    if path.startswith("hf"):
        model = _hf_model(config, device)
        if path == "hf_fsdp_compiled":
            return model, _hf_fsdp_compiled(model, device)
        runner = torch.compile(model) if path == "hf_compiled" else model

        def forward(inputs: Any) -> Any:
            return runner(input_ids=inputs, use_cache=False).logits

        return model, forward

    if path in TITAN_PATHS:
        return _titan_model(args, config, device, path)
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


def _hf_model(config: Any, device: Any) -> Any:
    """transformers' causal LM of ``config``'s shape (``Qwen3ForCausalLM``, or ``Qwen3MoeForCausalLM`` for the MoE
    shape): sdpa attention, fp32 parameters, no KV cache, the head tied where the config ties it; on ``device``
    (``meta`` for the Trainer paths: the strategy materialises it and initialises it by transformers' rules)."""
    import torch
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf_config(), attn_implementation="sdpa"
        )
    model = model.to(device=device, dtype=torch.float32)
    model.config.use_cache = False
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        raise RuntimeError(f"HF model uses attn_implementation={attn!r}, expected 'sdpa'")
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("HF model did not tie lm_head to embed_tokens")
    model.train()
    return model


# The adapters of every LoRA path: the projections of the decoder blocks (peft's target_modules, our targets).
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config() -> Any:
    """Our side's ``LoRA`` of the LoRA paths: ``LORA_RANK`` / ``LORA_ALPHA`` on ``LORA_TARGETS``, no dropout, the
    frozen base in bf16 (the adapters stay in the model's fp32)."""
    import torch

    from lightning_d9d.plans.lora import LoRA

    return LoRA(rank=LORA_RANK, alpha=LORA_ALPHA, targets=LORA_TARGETS, base_dtype=torch.bfloat16)


def _peft_model(config: Any, device: Any, seed: int) -> Any:
    """The LoRA baseline's model as a user builds it without us: transformers' causal LM of ``config``'s shape built
    in bf16 on ``device``, sdpa attention, no KV cache, then ``peft.get_peft_model`` with the same adapters as
    ``lora_config``: every other weight frozen, the adapters in fp32 (peft's default beside bf16 weights, as ours).

    It starts from the Trainer paths' weights, not from torch's RNG: the base as the strategy initialises a
    transformers model built on meta (:func:`transformers_start_` from ``seed``), each adapter as the LoRA plan
    initialises it under the name the Trainer paths give that layer (:func:`peft_adapter_start_`), so the loss
    guard compares runs that differ only in how they compute."""
    import peft
    import torch
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf_config(), attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.config.use_cache = False
    transformers_start_(model, seed)
    adapters = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    adapted = peft.get_peft_model(model, adapters)
    peft_adapter_start_(adapted, seed)
    adapted.train()
    return adapted


# The attribute CausalLMTraining holds its model under: the first part of every parameter name on the Trainer paths,
# which the LoRA plan seeds each adapter by (``model.model.layers.0.self_attn.q_proj``)
TRAINER_MODEL_ATTRIBUTE = "model"
# What peft puts before a transformers model's own names (``base_model.model.model.layers.0...``)
PEFT_PREFIX = "base_model.model."


def transformers_start_(model: Any, seed: int) -> None:
    """Overwrite transformers model ``model``'s parameters and buffers with the start the strategy gives a
    transformers model built on meta (``D9DStrategy``'s materialisation: ``init_transformers_model_`` from the
    seed all ranks agree on, ``torch.initial_seed()`` of rank 0): transformers' rules drawn in fp32 from
    ``(seed, module name)``, cast to each tensor's dtype."""
    from lightning_d9d.modules.hf_init import init_transformers_model_

    missed = init_transformers_model_(model, seed)
    if missed:
        raise RuntimeError(f"no transformers rule initialises {missed[:5]}: they would start as NaN")


def peft_adapter_start_(model: Any, seed: int) -> None:
    """Each of peft's adapters (``lora_A`` / ``lora_B``) of ``model`` as the LoRA plan starts the same layer on the
    Trainer paths: :func:`~lightning_d9d.modules.lora.init_adapter_` under the layer's name there, ``A`` drawn
    from ``(seed, <name>.lora_A.weight)``, ``B`` zero."""
    from typing import cast

    from peft.tuners.lora import LoraLayer
    from torch import nn

    from lightning_d9d.modules.lora import LoRALinear, init_adapter_

    started = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.active_adapters:
            # init_adapter_ reads the two linears of an adapter: peft keeps them in dicts by adapter name
            pair = nn.Module()
            pair.lora_A, pair.lora_B = layer.lora_A[adapter], layer.lora_B[adapter]
            init_adapter_(cast(LoRALinear, pair), trainer_param_name(name), seed)
            started += 1
    if not started:
        raise RuntimeError(f"{type(model).__name__} holds no peft LoRA layer to start")


def trainer_param_name(name: str) -> str:
    """A parameter's (or module's) name as the Trainer paths' LightningModule names it: without the wrappers compile
    and activation checkpointing add, a peft model's names as our adapted layers' (``base_model.model.X`` ->
    ``model.X``, ``q_proj.base_layer.weight`` -> ``q_proj.weight``, ``q_proj.lora_A.default.weight`` ->
    ``q_proj.lora_A.weight``)."""
    from lightning_d9d.modules.init import canonical_param_name

    name = canonical_param_name(name)
    if not name.startswith(PEFT_PREFIX):
        return name
    name = f"{TRAINER_MODEL_ATTRIBUTE}.{name.removeprefix(PEFT_PREFIX)}"
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.", f".{part}.").removesuffix(f".{part}.default")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def transformers_start_into_(model: Any, config: Any, seed: int) -> None:
    """Give our model ``model`` (LoRA applied, materialised) the frozen base transformers' model of ``config``'s
    shape starts from (:func:`transformers_start_`, the same parameter names): built on meta in the base dtype,
    initialised on the CPU, copied by name. The adapters keep the LoRA plan's start, which the paths share."""
    import torch

    from lightning_d9d.modules.init import assign_full_, canonical_param_name
    from lightning_d9d.strategies.materialize import to_empty_except_metrics

    source = _hf_model(config, "meta").to(lora_config().base_dtype)
    to_empty_except_metrics(source, torch.device("cpu"))  # keeps a tied embedding one tensor
    transformers_start_(source, seed)
    weights = dict(source.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:  # an adapter
            continue
        weight = weights.get(canonical_param_name(name))
        if weight is None or weight.shape != param.shape or weight.dtype != param.dtype:
            found = None if weight is None else (tuple(weight.shape), weight.dtype)
            raise RuntimeError(
                f"{name} {tuple(param.shape)} {param.dtype}: transformers' model holds {found} under that name"
            )
        assign_full_(param, weight)


def start_fingerprint(named: Any) -> dict[str, str]:
    """Digests of a model's parameters, named as the Trainer paths name them (:func:`trainer_param_name`):
    ``base`` (the frozen weights) and ``adapters`` (``lora_A`` / ``lora_B``). Equal digests: the same names, dtypes,
    shapes and bits. Each tensor is summed on its own device (:func:`_bits_checksum`): seconds for 8B weights."""
    import hashlib

    digests = {part: hashlib.blake2b(digest_size=8) for part in ("base", "adapters")}
    for name, tensor in sorted(((trainer_param_name(n), p) for n, p in named), key=lambda item: item[0]):
        part = "adapters" if ".lora_A." in name or ".lora_B." in name else "base"
        line = f"{name} {tensor.dtype} {tuple(tensor.shape)} {_bits_checksum(tensor)}\n"
        digests[part].update(line.encode())
    return {part: digest.hexdigest() for part, digest in digests.items()}


# a Mersenne prime: each element's term (its bits x a weight of its position, modulo this) stays below 2^31, so a
# chunk's int64 sum is exact
_CHECKSUM_MODULUS, _CHECKSUM_CHUNK = 2**31 - 1, 2**24


def _bits_checksum(tensor: Any) -> int:
    """A position-weighted sum of ``tensor``'s bits (a ``DTensor``'s whole value), exact in int64 arithmetic."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = 0
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        chunk = bits[start : start + _CHECKSUM_CHUNK].to(torch.int64) % _CHECKSUM_MODULUS
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65_521 + 1
        total += int((chunk * weights % _CHECKSUM_MODULUS).sum())
    return total % _CHECKSUM_MODULUS


class LogitsLoss:
    """``causal_lm_loss`` on a transformers output's ``.logits``, counting the same tokens (a ``CountedLoss``).

    ``hf_trainer*`` pass ``causal_lm_loss`` itself to ``model_loss`` where that takes a transformers output (the
    strategy then computes the fused LM head + cross-entropy from the hidden states, as for our models: issue
    24); until it does (``causal_lm_loss`` reads ``.shape`` of its first argument: AttributeError on a
    ``CausalLMOutputWithPast``), this wrapper runs instead, on the logits.
    """

    def __call__(self, output: Any, labels: Any) -> Any:
        from lightning_d9d.modules.loss import causal_lm_loss

        return causal_lm_loss(output.logits, labels)

    def count(self, labels: Any) -> Any:
        from lightning_d9d.modules.loss import causal_lm_loss

        return causal_lm_loss.count(labels)

    def __repr__(self) -> str:
        return "LogitsLoss(causal_lm_loss on output.logits)"


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


def _hf_fsdp_compiled(model: Any, device: Any, layers: Any = None) -> Any:
    """transformers' model as torchtitan-style training would run it on one rank: ``torch.compile`` per decoder
    layer, then FSDP2 per layer and the root with bf16 parameters and fp32 gradient reduction. ``layers``: the
    decoder layers where they are not ``model.model.layers`` (a ``PeftModel``'s)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers if layers is None else layers:
        layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    def forward(inputs: Any) -> Any:
        return model(input_ids=inputs, use_cache=False).logits

    return forward


def run_plain_loop(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_d9d.modules.loss import causal_lm_loss

    device = _device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t_setup = time.perf_counter()
    model, forward = build_model(path, args, device)
    n_params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    inputs, labels = _batches(args, _config(args).vocab_size, device)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    # FSDP2's MixedPrecisionPolicy does the casting for FSDP_LOOPS; every other plain loop autocasts.
    autocast: AbstractContextManager[Any] = (
        nullcontext() if path in FSDP_LOOPS else torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    )
    _sync(device)
    setup_s = time.perf_counter() - t_setup
    # LoRA: what the loss guard's comparison rests on, that every path starts from the same weights
    start = start_fingerprint(model.named_parameters()) if path in LORA_PATHS else None
    events = _Events(device)
    stall = GpuStall(device, args.gpu_stall_ms)
    losses: list[Any] = []

    # torchtitan's trainer scores its model with its own compiled loss; every other path with ours.
    loss_fn = _titan_loss() if path in TITAN_PATHS else causal_lm_loss

    def step(marks: dict[str, Any] | None) -> None:
        i = len(losses)  # this step's batch
        if marks is not None:
            events.mark(marks, "start")
        stall()
        with autocast:
            loss = loss_fn(forward(inputs[i]), labels[i])
        if marks is not None:
            events.mark(marks, "forward")
        loss.backward()
        if marks is not None:
            events.mark(marks, "backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if marks is not None:
            events.mark(marks, "end")
        losses.append(loss.detach())

    warmup_times = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        step(None)
        _sync(device)
        warmup_times.append(time.perf_counter() - t)
    warmup_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # peak_mem_gib: the measured steps only
    steps: list[dict[str, Any]] = []
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        marks: dict[str, Any] = {}
        step(marks)
        steps.append(marks)
    _sync(device)
    elapsed = time.perf_counter() - t0
    probe = SyncProbe(device)
    probe.start()
    for _ in range(args.probe_steps):
        step(None)
    sync_probe = probe.stop()
    _sync(device)
    if args.profile_steps:  # after the probe's steps, as on the Trainer paths
        with _profiler(device) as profile:
            for _ in range(args.profile_steps):
                step(None)
            _sync(device)
        _write_profile(profile, args, path)

    result: dict[str, Any] = {
        "n_params": n_params,
        "trainable_params": sum(p.numel() for p in trainable),
        "setup_s": setup_s,
        "peak_mem_warmup_gib": warmup_peak,
        "first_step_s": warmup_times[0] if warmup_times else None,
        "warmup_s": sum(warmup_times),
        "elapsed_s": elapsed,
        "losses": [float(x) for x in losses],
        "sync_probe": sync_probe,
    }
    if start is not None:
        result["start"] = start
    if events.enabled and steps:
        result["step_ms"] = _summary([_ms(s["start"], s["end"]) for s in steps])
        result["forward_ms"] = _summary([_ms(s["start"], s["forward"]) for s in steps])
        result["backward_ms"] = _summary([_ms(s["forward"], s["backward"]) for s in steps])
        result["optimizer_ms"] = _summary([_ms(s["backward"], s["end"]) for s in steps])
        # Device idle between steps (host launch latency the GPU waited for).
        result["gap_ms"] = _summary([_ms(a["end"], b["start"]) for a, b in itertools.pairwise(steps)])
    if path == "ours_fsdp_loop" and device.type == "cuda" and args.time_adamw:
        result["adamw_ms"] = _time_adamw_variants(model, args)
    return result


def _time_adamw_variants(model: Any, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of one AdamW step over this model's parameters: foreach (the example's default) vs fused."""
    import torch

    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, kwargs in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
        times = []
        for i in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        out[name] = statistics.median(times)
        del opt
    return out


def run_trainer(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    import lightning_d9d
    from lightning_d9d import D9DStrategy
    from lightning_d9d.callbacks import GarbageCollection

    # The example next to the package that is imported (the working tree's, or a snapshot's).
    sys.path.insert(0, str(Path(lightning_d9d.__file__).resolve().parents[1] / "examples"))
    from pretrain_qwen3 import Qwen3Pretraining  # the example's LightningModule, unchanged

    device = _device(args)
    config = _config(args)
    # The strategy initialises the meta-built model from torch.initial_seed(): unseeded, every path started from
    # other weights (two runs of the same model differed by 0.02-0.03 in their first step's loss, 2026-12-05)
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
    strategy = D9DStrategy(
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
    from lightning_d9d.modules.loss import causal_lm_loss

    class LeanPretraining(Qwen3Pretraining):
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

    class CausalLMTraining(L.LightningModule):
        """A causal LM in a LightningModule as a user writes one: built on ``meta`` by ``build`` in
        ``configure_model`` (transformers' model: the strategy shards it with the transformers adapter's plan, then
        initialises it by transformers' ``_init_weights`` rules; ours: by its own plan and ``init_weights``), the
        loss through ``lightning_d9d.model_loss`` with ``causal_lm_loss``, the plain loops' fused AdamW over the
        parameters that train (with LoRA: the adapters) at a constant learning rate, the loss logged without
        ``prog_bar``. ``lean`` (``hf_trainer_compiled_lean``): the loss on ``output.logits`` outside
        ``model_loss``, as :class:`LeanPretraining` scores ours. ``start``: what the model is given once the
        strategy has initialised it, before the first step (the LoRA path of our model: the weights the other
        LoRA paths start from)."""

        def __init__(
            self, build: Any, lean: bool, master_weights: bool, start: Callable[[Any], None] | None = None
        ) -> None:
            super().__init__()
            self.build = build
            self.lean = lean
            self.master_weights = master_weights
            self.start = start
            self.model: Any = None
            # causal_lm_loss, or LogitsLoss until causal_lm_loss takes a transformers output: tried at step 0
            self.loss_fn: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = self.build()

        def on_fit_start(self) -> None:  # after the strategy's setup: the model is materialised
            if self.start is not None:
                self.start(self.model)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            ids, target = batch["input_ids"], batch["labels"]
            loss = None
            if self.lean:
                loss = causal_lm_loss(self.model(input_ids=ids).logits, target)
            elif self.loss_fn is None:  # step 0: does causal_lm_loss take the transformers output yet?
                try:  # (then the strategy computes the fused LM head + loss from the hidden states: issue 24)
                    loss = lightning_d9d.model_loss(self, self.model, (ids,), target, causal_lm_loss)
                    self.loss_fn = causal_lm_loss
                except AttributeError as error:  # not yet: it wants logits (LogitsLoss's docstring)
                    print(f"causal_lm_loss refused the transformers output ({error}): LogitsLoss", flush=True)
                    self.loss_fn = LogitsLoss()
            if loss is None:  # (a retry runs here, outside the except block: the failed graph is freed)
                loss = lightning_d9d.model_loss(self, self.model, (ids,), target, self.loss_fn)
            self.log("train/loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            hyper: dict[str, Any] = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
            trainable = [p for p in self.parameters() if p.requires_grad]
            if self.master_weights:
                from lightning_d9d.optim import MasterWeightAdamW

                return MasterWeightAdamW(trainable, **hyper)
            fused: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
            return torch.optim.AdamW(trainable, **hyper, **fused)

    def our_model_on_meta() -> Any:
        with torch.device("meta"):
            return _model_class(config)(config)

    module: L.LightningModule
    if path.startswith("hf_trainer"):
        module = CausalLMTraining(
            lambda: _hf_model(config, "meta"),
            lean=path.endswith("_lean"),
            master_weights=_master_weights(path),
        )
    elif path in LORA_PATHS:  # our model in the transformers paths' module: only the model differs
        # its base starts from transformers' weights, as the other LoRA paths' (our init_weights draws other
        # values), so that the loss guard compares like with like; the adapters start alike already
        module = CausalLMTraining(
            our_model_on_meta,
            lean=False,
            master_weights=_master_weights(path),
            start=lambda model: transformers_start_into_(model, config, args.seed),
        )
    else:
        module_cls = LeanPretraining if path.endswith("_lean") else Qwen3Pretraining
        # The plain loops' constant learning rate (no warm-up, a cosine over 10^9 steps), so that the loss guard
        # compares runs that took the same optimizer steps; the schedule costs nothing measurable either way.
        module = module_cls(
            config, lr=args.lr, warmup_steps=0, max_steps=10**9, master_weights=_master_weights(path)
        )
    trainer.fit(module, DataLoader(FixedBatches(), batch_size=args.batch_size, num_workers=0))
    assert module.model is not None
    result: dict[str, Any] = {
        "n_params": sum(p.numel() for p in module.model.parameters()),
        "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
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
    announced = getattr(sys.modules.get("lightning_d9d.models.causal_lm"), "_ANNOUNCED", None)
    result["fused_loss"] = None if announced is None else "fused" in announced
    # a named backend runs or refuses (the path then fails): the name is what ran
    result["attention_backend"] = os.environ.get("LIGHTNING_D9D_ATTENTION") or "auto"
    if isinstance(module, CausalLMTraining):  # which loss ran: causal_lm_loss itself, or the logits wrapper
        lean = path.endswith("_lean")
        result["loss_fn"] = (
            "causal_lm_loss on output.logits" if lean else repr(getattr(module, "loss_fn", None))
        )
    if len(timer.ends) > 1:
        result["step_ms"] = _summary([_ms(a, b) for a, b in itertools.pairwise(timer.ends)])
    return result


def run_matmul_peak(args: argparse.Namespace) -> dict[str, Any]:
    """The bf16 matmul rate this GPU reaches on random data (a ceiling for MFU, next to the datasheet's)."""
    import torch

    n = 8192
    sets = [
        (
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for i in range(10):
        torch.mm(*sets[i % 2], out=out)
    torch.cuda.synchronize()
    times = []
    for i in range(40):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(*sets[i % 2], out=out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return {"matmul_n": n, "matmul_ms": ms, "matmul_tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def worker(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {"path": path}
    try:
        if path == "matmul_peak":
            result.update(run_matmul_peak(args))
        elif path.startswith(("ours_trainer", "hf_trainer")):
            result.update(run_trainer(path, args))
        else:
            result.update(run_plain_loop(path, args))
        if args.device == "cuda":
            result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["gpu_name"] = torch.cuda.get_device_name(0)
        result["ok"] = True
    except Exception as error:  # reported in the table; the other paths still run
        traceback.print_exc()
        result["ok"] = False
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
    return result


# ===================================================================================================== parent
def versions() -> dict[str, Any]:
    """Library versions without initialising CUDA in the parent (the workers own the GPUs)."""
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "transformers", "triton"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    info["cuda"] = torch.version.cuda
    import lightning_d9d

    info["lightning_d9d"] = str(Path(lightning_d9d.__file__).resolve().parent)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["gpus"] = [line.strip() for line in smi.stdout.strip().splitlines()]
        info["driver"] = info["gpus"][0].split(", ")[2] if info["gpus"] else None
    except (OSError, subprocess.SubprocessError, IndexError):
        info["gpus"], info["driver"] = [], None
    return info


def flops_per_token(args: argparse.Namespace) -> int:
    import torch

    config = _config(args)
    with torch.device("meta"):
        return int(_model_class(config)(config).num_flops_per_token(args.seq_len))


def _split_attention(path: str) -> tuple[str, str | None]:
    """A path without its attention suffix, and the backend that suffix forces (None: no suffix)."""
    for suffix, backend in ATTENTION_SUFFIXES.items():
        if path.endswith(suffix):
            return path.removesuffix(suffix), backend
    return path, None


def _master_weights(path: str) -> bool:
    """Whether a path trains with MasterWeightAdamW: ``_master`` last, before an attention suffix if it has one."""
    return _split_attention(path)[0].endswith("_master")


def path_environment(path: str) -> dict[str, str]:
    """The variables a path's worker runs with beyond the caller's: the attention backend its suffix forces."""
    backend = _split_attention(path)[1]
    return {} if backend is None else {"LIGHTNING_D9D_ATTENTION": backend}


def launch(job: int, path: str, gpu: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Run one path in a fresh interpreter pinned to one GPU; its result is the last JSON line it prints."""
    env = dict(os.environ)
    # An explicit PYTHONPATH (a snapshot of the package, say) comes before the working tree.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(REPO)]))
    env["PYTHONUNBUFFERED"] = "1"
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(29500 + 17 * job + int(gpu or 0))
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if args.compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    env.update(path_environment(path))
    if not args.shared_compile_cache:  # cold compile caches: warm-up times do not depend on the path order
        env["TORCHINDUCTOR_CACHE_DIR"] = str(logdir / f"{job:02d}_inductor")
        env["TRITON_CACHE_DIR"] = str(logdir / f"{job:02d}_triton")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", path, *args.passthrough]
    log = logdir / f"{job:02d}_{path}.log"
    start = time.perf_counter()
    with log.open("w") as handle:
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=args.path_timeout
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"path": path, "ok": False, "error": f"worker exit {rc}, no result"}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            break
    probe = result.get("sync_probe")
    if probe is not None:  # syncs that C++ printed (no Python frame) between the probe's markers
        lines = log.read_text(errors="replace").splitlines()
        if SyncProbe.START in lines and SyncProbe.END in lines:
            start = len(lines) - 1 - lines[::-1].index(SyncProbe.START)
            window = lines[start : lines.index(SyncProbe.END, start)]
            probe["native_syncs"] = sum("synchronizing CUDA operation" in line for line in window)
    if rc != 0 and result.get("ok"):
        result["note"] = f"worker exit {rc} after reporting"
    result.update({"job": job, "gpu": gpu, "wall_s": wall})
    status = "ok" if result.get("ok") else f"FAILED ({result.get('error')})"
    print(f"[{time.strftime('%H:%M:%S')}] gpu {gpu}: {path} {status} in {wall:.0f}s", flush=True)
    if not result.get("ok"):
        print("\n".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    return result


def derive(results: list[dict[str, Any]], args: argparse.Namespace, fpt: int) -> None:
    tokens_per_step = args.batch_size * args.seq_len
    for r in results:
        if r.get("ok") and r.get("elapsed_s"):
            r["tokens_per_s"] = tokens_per_step * args.steps / r["elapsed_s"]
            r["model_tflops"] = fpt * r["tokens_per_s"] / 1e12
            r["mfu"] = r["model_tflops"] / args.peak_tflops
    base = {}
    for name in BASELINES:  # the first run of each baseline (a repeat, if any, measures the spread)
        first = next((r for r in results if r["path"] == name and r.get("tokens_per_s")), None)
        if first is not None:
            base[name] = first
    for r in results:
        for name, baseline in base.items():
            if r.get("tokens_per_s"):
                r[f"vs_{name}"] = r["tokens_per_s"] / baseline["tokens_per_s"]  # mean tokens/s
            if _median(r, "step_ms") and _median(baseline, "step_ms"):
                r[f"median_vs_{name}"] = _median(baseline, "step_ms") / _median(r, "step_ms")
    check_losses(results)


def _median(result: dict[str, Any], key: str) -> Any:
    """The median of a per-step summary (``_summary``), None where the path recorded none."""
    return (result.get(key) or {}).get("median")


LOSS_TOLERANCE = 0.02


def check_losses(results: list[dict[str, Any]]) -> None:
    """The correctness guard: every path trains on the same batch with the same optimizer and learning rate, so
    its loss after the last step must be finite and within ``LOSS_TOLERANCE`` (relative) of the baseline's (the
    first baseline path that ran). Sets ``final_loss``, ``loss_vs_baseline`` and ``loss_ok`` on each result."""
    trained = [r for r in results if r.get("ok") and r.get("losses")]
    baseline = next((r for name in BASELINES for r in trained if r["path"] == name), None)
    for r in trained:
        final = r["losses"][-1]
        r["final_loss"] = final
        if baseline is None:
            r["loss_ok"] = math.isfinite(final)
            continue
        relative = final / baseline["losses"][-1] - 1
        r["loss_vs_baseline"] = relative
        r["loss_ok"] = math.isfinite(final) and abs(relative) <= LOSS_TOLERANCE


def _label(r: dict[str, Any], results: list[dict[str, Any]]) -> str:
    earlier = [x for x in results if x["path"] == r["path"] and x["job"] < r["job"]]
    return f"{r['path']} (repeat {len(earlier)})" if earlier else r["path"]


def markdown(
    results: list[dict[str, Any]], meta: dict[str, Any], ratios: tuple[str, ...] = RATIO_COLUMNS
) -> str:
    """The run's tables: speed and memory (a ``vs`` column for each baseline in ``ratios``), where the step
    goes, the loss guard, and the shape and software measured."""

    def fmt(value: Any, spec: str) -> str:
        return (
            "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
        )

    rows = [r for r in results if r["path"] != "matmul_peak"]
    lines = [
        # the ratios of the median step, which issue 25's targets name; tokens/s (and MFU) count the whole
        # measured window, so one slow step of a path moves them and not its median
        "| path | tokens/s | MFU | step ms (median) | peak mem GiB | "
        + " | ".join(f"vs {name}" for name in ratios)
        + " (median steps) | GPU |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(ratios) + "---:|",
    ]
    for r in rows:
        if not r.get("ok"):
            lines.append(
                f"| {_label(r, results)} | failed: {str(r.get('error'))[:150]} |"
                + " |" * (3 + len(ratios))
                + f" {r.get('gpu')} |"
            )
            continue
        lines.append(
            f"| {_label(r, results)} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu', 0) * 100, '.1f')}% "
            f"| {fmt(_median(r, 'step_ms'), '.1f')} | {fmt(r.get('peak_mem_gib'), '.1f')} | "
            + " | ".join(fmt(r.get(f"median_vs_{name}"), ".2f") for name in ratios)
            + f" | {r.get('gpu')} |"
        )
    lines += [
        "",
        "| path | forward+loss ms | backward ms | optimizer ms | idle between steps ms | host syncs/step "
        "| first step s | warm-up s | peak mem in warm-up GiB | final loss | vs baseline's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.get("ok"):
            continue
        probe = r.get("sync_probe") or {}
        syncs = probe.get("syncs")
        native = probe.get("native_syncs", 0)
        per_step = None if syncs is None else (syncs + native) / max(1, meta["probe_steps"])
        lines.append(
            f"| {_label(r, results)} | {fmt(_median(r, 'forward_ms'), '.1f')} | {fmt(_median(r, 'backward_ms'), '.1f')} "
            f"| {fmt(_median(r, 'optimizer_ms'), '.1f')} | {fmt(_median(r, 'gap_ms'), '.2f')} | {fmt(per_step, '.1f')} "
            f"| {fmt(r.get('first_step_s'), '.1f')} | {fmt(r.get('warmup_s'), '.1f')} "
            f"| {fmt(r.get('peak_mem_warmup_gib'), '.1f')} | {fmt(r.get('final_loss'), '.4f')} "
            f"| {fmt(100 * r['loss_vs_baseline'] if 'loss_vs_baseline' in r else None, '+.2f')}% |"
        )
    failed = [_label(r, results) for r in rows if r.get("ok") and r.get("loss_ok") is False]
    lines += [
        "",
        f"loss guard (final loss finite and within {LOSS_TOLERANCE:.0%} of the baseline's): "
        + (f"FAILED for {', '.join(failed)}" if failed else "passed"),
    ]
    v = meta["versions"]
    peak = next((r for r in results if r["path"] == "matmul_peak" and r.get("ok")), None)
    lines += [
        "",
        f"shape: {meta['model']} (seq_len {meta['seq_len']}, micro-batch {meta['batch_size']}, "
        f"{meta['tokens_per_step']} tokens/step), warm-up {meta['warmup']} + {meta['steps']} measured steps; "
        f"{meta['flops_per_token'] / 1e9:.3f} GFLOP/token; MFU against {meta['peak_tflops']:g} TFLOP/s.",
        f"torch {v['torch']}, lightning {v['lightning']}, transformers {v['transformers']}, "
        f"triton {v['triton']}, CUDA {v['cuda']}, driver {v.get('driver')}, GPU {v.get('gpus')}; {meta['date']}.",
    ]
    if meta.get("gpu_stall_ms"):
        lines.append(f"host-bound probe: a {meta['gpu_stall_ms']:g} ms GPU spin queued at every step's start")
    if meta.get("note"):
        lines.append(f"note: {meta['note']}")
    if peak is not None:
        lines.append(
            f"measured bf16 matmul ({peak['matmul_n']}^3, random data): {peak['matmul_tflops']:.0f} TFLOP/s; "
            "MFU against it: "
            + ", ".join(
                f"{_label(r, results)} {100 * r['model_tflops'] / peak['matmul_tflops']:.1f}%"
                for r in rows
                if r.get("model_tflops")
            )
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help="comma list; repeats allowed")
    parser.add_argument(
        "--model",
        choices=["0.6b", "1.7b", "4b", "8b", "tiny", "moe", "moe_large", "moe_tiny"],
        default="0.6b",
    )
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (micro-batch)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--probe-steps", type=int, default=2, help="extra steps that count host syncs")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps after the probe (kernel kinds, GPU gaps and kernel table in --out)",
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--time-adamw", type=int, default=1, help="ours_fsdp_loop: also time isolated AdamW steps (1/0)"
    )
    parser.add_argument(
        "--gpu-stall-ms",
        type=float,
        default=0.0,
        help="queue a GPU spin of this many ms at every step's start (host-bound probe: GpuStall)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", default="0", help="GPU indices to spread the paths over, one path per GPU")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU")
    parser.add_argument("--matmul-peak", action="store_true", help="also measure the bf16 matmul rate")
    parser.add_argument("--path-timeout", type=int, default=300, help="seconds per path")
    parser.add_argument(
        "--shared-compile-cache",
        action="store_true",
        help="let the paths share inductor/triton's on-disk caches (faster warm-up, order-dependent)",
    )
    parser.add_argument(
        "--compile-threads", type=int, default=0, help="TORCHINDUCTOR_COMPILE_THREADS (0: default)"
    )
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--note", default="", help="free text kept in the output (e.g. the commit measured)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/benchmarks")))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.passthrough = [
        f"--model={args.model}",
        f"--layers={args.layers}",
        f"--seq-len={args.seq_len}",
        f"--batch-size={args.batch_size}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--probe-steps={args.probe_steps}",
        f"--profile-steps={args.profile_steps}",
        f"--out={args.out}",
        f"--lr={args.lr}",
        f"--time-adamw={args.time_adamw}",
        f"--seed={args.seed}",
        f"--gpu-stall-ms={args.gpu_stall_ms}",
        f"--device={args.device}",
    ]
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    return args


MODEL_NAMES = {
    "0.6b": "Qwen3-0.6B shape",
    "1.7b": "Qwen3-1.7B shape",
    "4b": "Qwen3-4B shape",
    "8b": "Qwen3-8B shape",
    "tiny": "Qwen3 tiny",
    "moe": "Qwen3-MoE 16 layers, hidden 1024, 64 experts of 384, top-8 (active-parameter MFU)",
    "moe_large": "Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8; active-parameter MFU)",
    "moe_tiny": "Qwen3-MoE tiny",
}


def run_meta(args: argparse.Namespace, fpt: int, gpus: list[str]) -> dict[str, Any]:
    """What a run measured, for its JSON and the tables' last lines: shape, steps, recipe, software, command."""
    return {
        "date": args.date,
        # the depth where --layers set it, or where the name does not give it (moe_large's own, from its config)
        "model": MODEL_NAMES[args.model]
        + (f", {_config(args).num_hidden_layers} layers" if args.layers or args.model == "moe_large" else ""),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_step": args.batch_size * args.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "probe_steps": args.probe_steps,
        "gpu_stall_ms": args.gpu_stall_ms,
        "peak_tflops": args.peak_tflops,
        "flops_per_token": fpt,
        "precision": "fp32 master weights + torch.autocast(bf16) in the plain loops; bf16-mixed (FSDP2 "
        "MixedPrecisionPolicy) in ours_fsdp_loop and the Trainer paths",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1), fused on CUDA, constant lr, in the plain "
        "loops; the example's configure_optimizers (the same AdamW, fused on CUDA; its LambdaLR made constant: "
        "no warm-up, cosine over 10^9 steps) in the ours_trainer paths; the plain loops' AdamW in the hf_trainer "
        "paths",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "note": args.note,
        "gpus_used": gpus,
        "versions": versions(),
        "host": platform.node(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    lora = [p for p in paths if p in LORA_PATHS]
    if lora:  # their MFU counts the frozen weights apart, and their baseline is peft's
        raise SystemExit(f"{lora} are LoRA paths: run them with benchmarks/lora_throughput.py")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    if args.matmul_peak and args.device == "cuda":
        paths = ["matmul_peak", *paths]
    gpus = [g.strip() for g in args.gpus.split(",")] if args.device == "cuda" else [""]
    args.out.mkdir(parents=True, exist_ok=True)
    # Per-path logs, merged into one file under --out after each path.
    logdir = args.logdir = Path(tempfile.mkdtemp(prefix="train_throughput_"))
    fpt = flops_per_token(args)
    meta = run_meta(args, fpt, gpus)
    print(f"paths: {paths} on GPUs {gpus}; {fpt / 1e9:.3f} GFLOP/token", flush=True)

    jobs: queue.Queue[tuple[int, str]] = queue.Queue()
    # Compiling paths take longest: start them first so that several GPUs finish together.
    for job, path in sorted(
        enumerate(paths), key=lambda jp: (jp[1] != "matmul_peak", "compiled" not in jp[1])
    ):
        jobs.put((job, path))
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def drain(gpu: str) -> None:
        while True:
            try:
                job, path = jobs.get_nowait()
            except queue.Empty:
                return
            result = launch(job, path, gpu, args, logdir)
            with lock:
                results.append(result)
                _write(args.out, meta, sorted(results, key=lambda r: r["job"]), args, fpt)

    threads = [threading.Thread(target=drain, args=(gpu,)) for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.sort(key=lambda r: r["job"])
    table = _write(args.out, meta, results, args, fpt)
    print(table, flush=True)
    if any(r.get("loss_ok") is False for r in results):
        raise SystemExit("loss guard failed: a path's final loss is not within the band (see the table)")


def _write(
    out: Path,
    meta: dict[str, Any],
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    fpt: int,
) -> str:
    derive(results, args, fpt)
    table = markdown(results, meta)
    (out / "train_throughput.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "train_throughput.md").write_text(table + "\n")
    merge_logs(args.logdir, out / "train_throughput.log")
    return table


def merge_logs(logdir: Path, target: Path) -> None:
    """All worker logs in one file (the device tool returns few files), rewritten as paths finish."""
    with target.open("w") as handle:
        for log in sorted(logdir.glob("*.log")):
            handle.write(f"===== {log.name}\n{log.read_text(errors='replace')}\n")


if __name__ == "__main__":
    main()
