"""Step time of the example module on any layout of the d9d strategy, through ``Trainer(strategy=D9DStrategy(...))``.

One process per GPU (torchrun), the same global batch whatever the layout, so layouts compare by step time:

    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --dp-shard 2 --compile
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --tp 2 --compile
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --cp 2 --context-attention torch_ring
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --pp 2 --schedule 1F1B --microbatches 8
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --model moe --ep 2 --dispatcher deepep
    torchrun --standalone --nproc-per-node 1 benchmarks/layouts.py --compile          # the one-GPU reference
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --device cpu --model tiny --dp-shard 2  # smoke
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --impl hf    # the baseline on the same batches
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --impl hf_trainer --tp 2 --compile
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --dp-shard 2 --compile --fp8 tensorwise
    torchrun --standalone --nproc-per-node 2 benchmarks/layouts.py --tp 2 --compile --async-tp

``--impl hf`` is the recipe a strong user writes without us, as ``train_throughput.py``'s ``hf_fsdp_compiled``
path but over every rank: transformers' model, ``torch.compile`` per decoder layer, FSDP2 per layer and the root
over all ranks (bf16 parameters, fp32 gradient reduction), fused AdamW, in a plain loop fed by the same
``DistributedSampler`` the Trainer uses; data parallelism only. ``--impl hf_trainer`` is transformers' own model of
the same shape (``Qwen3ForCausalLM``, or ``Qwen3MoeForCausalLM`` for ``--model moe``) under the Trainer and
``D9DStrategy`` on any layout (the example's ``TransformersPretraining``: built on meta, the transformers adapter's
plans), beside ours on the same layouts.

The tokens are drawn from one fixed Zipf-like distribution (``train_throughput.py``'s loss-guard data: a model
learns it smoothly, so layouts whose numerics differ by bf16 rounding end within a fraction of a percent, while
uniform tokens would leave every run, broken or not, at ln(vocab)); every layout sees the same global batches.

Prints one JSON line (rank 0): the layout, median step time over the steps after ``--warmup``, tokens/s (all
GPUs and per GPU), MFU (``num_flops_per_token(seq_len)`` x tokens / (GPUs x ``--peak-tflops``); active parameters
for MoE), the peak memory of every rank and of the fullest, and every step's loss averaged over the ranks that
hold different tokens (``losses``, ``last_loss``, ``loss_last10_mean``: a layout that computes something else
shows there; ``benchmarks/compare_layouts.py`` holds them to the one-GPU row). A run that needs CUDA
(``--async-tp``, ``--context-attention torch_ring``, ``--dispatcher deepep``, ``--fp8 tensorwise`` under tp) asked
for with ``--device cpu`` prints ``{"skipped": reason, ...}`` instead and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_qwen3 import Qwen3Pretraining
from train_throughput import _model_class, _moe_config

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config


class ZipfTokens(Dataset):
    """Sample ``index``: ``seq_len + 1`` token ids drawn from one fixed Zipf-like distribution over the vocabulary
    (weight ``1 / (rank + 10)``, ranks a seeded permutation, as ``train_throughput._batches``), seeded by
    ``index``: the same rows whatever the layout or the loader's workers."""

    def __init__(self, vocab: int, seq_len: int, samples: int) -> None:
        self.seq_len, self.samples = seq_len, samples
        ranks = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
        self.weights = torch.empty(vocab)
        self.weights[ranks] = 1.0 / (torch.arange(vocab, dtype=torch.float32) + 10.0)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        tokens = torch.multinomial(self.weights, self.seq_len + 1, True, generator=generator)
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class StepTimer(Callback):
    """Host time of each training step between two device synchronisations."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []
        self.losses: list[float] = []
        self.start = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._sync()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._sync()
        self.times.append(time.perf_counter() - self.start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))  # after the timing: the read-back is outside the window


def run_hf_baseline(args: argparse.Namespace, config: Any) -> tuple[StepTimer, Any, int]:
    """The ``--impl hf`` loop (module docstring): ``(timer, the HF model, world size)``."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.data.distributed import DistributedSampler

    from lightning_d9d.modules.loss import causal_lm_loss

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(
        args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None
    )
    if args.device == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf_config(), attn_implementation="sdpa"
        )
    model.config.use_cache = False
    model.train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if args.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    fused = {"fused": True} if args.device == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    data = ZipfTokens(config.vocab_size, args.seq_len, args.global_batch * args.steps)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, num_workers=2)
    timer = StepTimer(args.device)
    for batch in loader:
        timer.on_train_batch_start(None, None, batch, 0)
        logits = model(input_ids=batch["input_ids"].to(device), use_cache=False).logits
        loss = causal_lm_loss(logits, batch["labels"].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.on_train_batch_end(None, None, loss, None, 0)
    return timer, model, world


def model_config(args: argparse.Namespace) -> Any:
    if args.model in ("moe", "moe_tiny"):
        return _moe_config(args.model)
    # A tied head cannot be split from the embedding over pipeline stages; --untied unties every layout's alike
    # (a loss comparison with pp=2 needs its one-GPU reference to be the same model).
    untied = {"tie_word_embeddings": False} if args.pp > 1 or args.untied else {}
    return Qwen3Config.qwen3_0_6b(**untied) if args.model == "0.6b" else Qwen3Config.tiny(**untied)


IMPLS = {"ours": "ours", "hf": "hf_fsdp_compiled", "hf_trainer": "hf_trainer"}  # --impl: the JSON's "impl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["0.6b", "tiny", "moe", "moe_tiny"], default="0.6b")
    parser.add_argument(
        "--impl",
        choices=list(IMPLS),
        default="ours",
        help="hf: the transformers + FSDP2 baseline (data parallel); hf_trainer: transformers' model under "
        "D9DStrategy (any layout)",
    )
    for degree in ("pp", "dp-replicate", "tp", "cp", "ep"):
        parser.add_argument(f"--{degree}", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1, help="-1: the ranks the other degrees leave")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", choices=["off", "selective", "full"], default="off")
    parser.add_argument("--context-attention", default="auto", choices=["auto", "all_gather", "torch_ring"])
    parser.add_argument("--dispatcher", default="all_to_all", choices=["all_to_all", "deepep"])
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None, help="D9DStrategy(fp8=...)")
    parser.add_argument(
        "--async-tp",
        action="store_true",
        help="D9DStrategy(async_tp=True): micro-pipelined TP (CUDA, compile)",
    )
    parser.add_argument("--untied", action="store_true", help="dense: an untied LM head (as pp > 1 needs)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, for MFU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    other = {d: getattr(args, d.replace("-", "_")) for d in ("pp", "dp-replicate", "tp", "cp", "ep")}
    if args.impl == "hf" and any(v > 1 for v in other.values()):
        parser.error(f"--impl hf shards data only (FSDP2 over all ranks); drop {other}")
    if args.impl == "hf" and (args.fp8 or args.async_tp):
        parser.error("--fp8 and --async-tp are D9DStrategy options: --impl ours or hf_trainer")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (the median is over the rest)")
    return args


def cuda_only(args: argparse.Namespace) -> str | None:
    """Why this run cannot run on ``--device cpu`` (a CUDA-only path asked for), or None."""
    if args.device == "cuda":
        return None
    if args.async_tp:
        return "--async-tp: micro-pipelined TP runs on CUDA only (symmetric memory, NCCL)"
    if args.cp > 1 and args.context_attention == "torch_ring":
        return "--context-attention torch_ring: torch's ring attention kernels run on CUDA only"
    if args.ep > 1 and args.dispatcher == "deepep":
        return "--dispatcher deepep: DeepEP's kernels run on CUDA only"
    if args.tp > 1 and args.fp8 == "tensorwise":
        return "--fp8 tensorwise --tp > 1: tp's float8 all-gathers need NCCL (gloo has no float8 type)"
    return None


def run_ours(args: argparse.Namespace, config: Any) -> tuple[StepTimer, Any, int, dict[str, int], Any]:
    """``Trainer(strategy=D9DStrategy(...))`` on the layout asked for, our model or (``--impl hf_trainer``)
    transformers': ``(timer, model, world size, layout, strategy)``."""
    from pretrain_qwen3 import TransformersPretraining

    devices = int(os.environ.get("WORLD_SIZE", "1"))
    checkpointing = {"off": False, "selective": "selective", "full": True}[args.activation_checkpointing]
    async_tp = {"async_tp": True} if args.async_tp else {}  # absent from a strategy that predates it
    strategy = D9DStrategy(
        pp=args.pp,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        cp=args.cp,
        tp=args.tp,
        ep=args.ep,
        pipeline_schedule=args.schedule,
        microbatches=args.microbatches if args.pp > 1 else None,
        compile=args.compile,
        activation_checkpointing=checkpointing,
        context_attention=args.context_attention,
        fp8=args.fp8,
        **async_tp,
    )
    timer = StepTimer(args.device)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=devices,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
    )
    module_class = TransformersPretraining if args.impl == "hf_trainer" else Qwen3Pretraining
    module = module_class(config, lr=1e-4, warmup_steps=1, max_steps=args.steps)
    data = ZipfTokens(config.vocab_size, args.seq_len, args.global_batch * args.steps)
    # Ranks that hold different tokens split the global batch; tp, cp and pp peers share theirs.
    data_ranks = devices // (args.pp * args.tp * args.cp)
    trainer.fit(module, DataLoader(data, batch_size=args.global_batch // data_ranks, num_workers=2))
    dims = strategy.parallel_dims
    layout = {k: getattr(dims, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    return timer, module.model, devices, layout, strategy


def mean_losses(args: argparse.Namespace, losses: list[float], strategy: Any) -> list[float]:
    """Every step's loss as one process over the global batch computes it: the mean over the ranks that hold
    different tokens (the strategy's ``reduce``: its ``loss`` view; the world for ``--impl hf``)."""
    values = torch.tensor(losses, dtype=torch.float64, device=args.device)
    if strategy is not None:
        values = strategy.reduce(values)
    elif dist.is_initialized():
        dist.all_reduce(values)  # gloo has no AVG
        values /= dist.get_world_size()
    return [round(float(v), 4) for v in values.cpu()]


def peak_memory_per_rank(args: argparse.Namespace) -> list[float]:
    """``torch.cuda.max_memory_allocated`` of every rank in GiB (0 on CPU), in rank order."""
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    mine = torch.tensor([peak], dtype=torch.float64, device=args.device)
    if not dist.is_initialized():
        return [round(peak, 2)]
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [round(float(x), 2) for x in every]


def main() -> None:
    args = parse_args()
    skip = cuda_only(args)
    if skip is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"skipped": skip, "impl": IMPLS[args.impl], "model": args.model}), flush=True)
        return
    os.environ["LIGHTNING_D9D_MOE_DISPATCH"] = args.dispatcher
    L.seed_everything(0, verbose=False)
    config = model_config(args)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    strategy = None
    if args.impl == "hf":
        timer, model, devices = run_hf_baseline(args, config)
        layout = {"dp_shard": devices}
    else:
        timer, model, devices, layout, strategy = run_ours(args, config)
        assert model is not None
    if args.impl == "ours":
        per_token = model.num_flops_per_token(args.seq_len)  # from the config: the whole model, any stage
    else:
        with torch.device("meta"):  # our model of the same config, for its FLOP count only
            per_token = _model_class(config)(config).num_flops_per_token(args.seq_len)
    step = statistics.median(timer.times[args.warmup :])
    tokens = args.global_batch * args.seq_len
    memory = peak_memory_per_rank(args)
    losses = mean_losses(args, timer.losses, strategy)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "impl": IMPLS[args.impl],
                    "model": args.model,
                    "tied": bool(config.tie_word_embeddings),
                    "layout": {k: v for k, v in layout.items() if v > 1} or {"one rank": 1},
                    "schedule": f"{args.schedule} mb={args.microbatches}" if args.pp > 1 else None,
                    "compile": args.compile,
                    "activation_checkpointing": args.activation_checkpointing,
                    "context_attention": args.context_attention if args.cp > 1 else None,
                    "dispatcher": args.dispatcher if args.ep > 1 else None,
                    "fp8": args.fp8,
                    "async_tp": args.async_tp,
                    "gpus": devices,
                    "seq_len": args.seq_len,
                    "global_batch": args.global_batch,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "step_s_median": round(step, 4),
                    "tokens_per_s": round(tokens / step),
                    "tokens_per_s_per_gpu": round(tokens / step / devices),
                    "mfu": round(per_token * tokens / step / (devices * args.peak_tflops * 1e12), 4),
                    "peak_mem_gib_max_rank": max(memory),
                    "peak_mem_gib_per_rank": memory,
                    "last_loss": losses[-1],
                    "loss_last10_mean": round(statistics.fmean(losses[-10:]), 4),
                    "losses": losses,
                    "torch": torch.__version__,
                    "lightning": L.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                }
            ),
            flush=True,
        )
    if args.impl == "hf":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
