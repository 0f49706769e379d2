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

Run (on a CUDA GPU, from the repository root):

    PYTHONPATH=. python benchmarks/train_throughput.py --out runs/bench            # all paths, GPU 0
    PYTHONPATH=. python benchmarks/train_throughput.py --gpus 0,1 --out runs/bench  # spread paths over 2 GPUs
    PYTHONPATH=. python benchmarks/train_throughput.py --device cpu --model tiny --seq-len 64 \
        --batch-size 2 --warmup 2 --steps 3 --paths hf_eager,ours_eager                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

# The harness is the throughput/ package beside this file (its __init__.py and benchmarks/README.md say what each
# module holds). This file is the command line, and names what other benchmarks and the tests import from it.
from throughput.instruments import GpuStall, SyncProbe, _batches, _summary
from throughput.paths import (
    ATTENTION_SUFFIXES,
    BASELINES,
    DEFAULT_PATHS,
    FSDP_LOOPS,
    LORA_PATHS,
    MOE_PATHS,
    PATHS,
    RATIO_COLUMNS,
    TITAN_PATHS,
    _master_weights,
    path_environment,
)
from throughput.paths_baseline import LogitsLoss
from throughput.paths_lora import (
    LORA_ALPHA,
    LORA_RANK,
    LORA_TARGETS,
    lora_config,
    peft_adapter_start_,
    start_fingerprint,
    trainer_param_name,
    transformers_start_,
    transformers_start_into_,
)
from throughput.plain_loop import build_model, run_plain_loop
from throughput.report import LOSS_TOLERANCE, check_losses, derive, markdown, run_meta, versions
from throughput.runner import REPO, launch, merge_logs, run
from throughput.shapes import MODEL_NAMES, QWEN3_SHAPES, _config, _model_class, _moe_config, flops_per_token
from throughput.trainer_loop import run_trainer
from throughput.worker import run_matmul_peak, worker

__all__ = [
    "ATTENTION_SUFFIXES",
    "BASELINES",
    "DEFAULT_PATHS",
    "FSDP_LOOPS",
    "LORA_ALPHA",
    "LORA_PATHS",
    "LORA_RANK",
    "LORA_TARGETS",
    "LOSS_TOLERANCE",
    "MODEL_NAMES",
    "MOE_PATHS",
    "PATHS",
    "QWEN3_SHAPES",
    "RATIO_COLUMNS",
    "REPO",
    "TITAN_PATHS",
    "GpuStall",
    "LogitsLoss",
    "SyncProbe",
    "_batches",
    "_config",
    "_master_weights",
    "_model_class",
    "_moe_config",
    "_summary",
    "build_model",
    "check_losses",
    "derive",
    "flops_per_token",
    "launch",
    "lora_config",
    "main",
    "markdown",
    "merge_logs",
    "parse_args",
    "path_environment",
    "peft_adapter_start_",
    "run_matmul_peak",
    "run_meta",
    "run_plain_loop",
    "run_trainer",
    "start_fingerprint",
    "trainer_param_name",
    "transformers_start_",
    "transformers_start_into_",
    "versions",
    "worker",
]


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return
    run(args)


if __name__ == "__main__":
    main()
