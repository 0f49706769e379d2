"""The path registry of ``train_throughput.py``: every path's name and one-line description, which of them run by
default, the baselines the tables compare with, and what a path's name says about how it runs (the attention
backend its suffix forces, master weights). How each path builds and steps its model is in the ``paths_*``
modules, ``plain_loop.py`` and ``trainer_loop.py``."""

from __future__ import annotations

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
    # transformers' model under the Trainer: the strategy picks the transformers adapter's plan.
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
    # the configuration of our model's best MoE step (docs/benchmarks.md, runs U2 and G5), for the adapter against
    # it in one run
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
    # FP8 training of the decoder blocks' linear layers through torchao: D9DStrategy(fp8=...). Under
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
    # CUDA graphs: compile="reduce-overhead" (Inductor's CUDA graph trees around each compiled block);
    # without FSDP on the one rank, whose per-step all-gathers would give the blocks new parameter addresses.
    "ours_trainer_compiled_nofsdp_cudagraphs": 'ours_trainer_compiled_nofsdp with compile="reduce-overhead"',
    "ours_trainer_compiled_nofsdp_master": "ours_trainer_compiled_nofsdp with MasterWeightAdamW: bf16 parameters,"
    " fp32 master weights in the optimizer",
    # the MoE step launches many short kernels (docs/benchmarks.md, run U9): graphs replay them
    "ours_trainer_compiled_nofsdp_cudagraphs_master": "ours_trainer_compiled_nofsdp_master with"
    ' compile="reduce-overhead"',
    # FlashAttention 4: the attention backend forced by LIGHTNING_D9D_ATTENTION=flash_attn4 in the
    # worker (refused, so the path fails, where flash_attn.cute cannot run); the pair to measure against cuDNN
    "ours_trainer_compiled_fa4": "ours_trainer_compiled with the flash_attn4 attention backend (FlashAttention 4)",
    "ours_trainer_compiled_nofsdp_fa4": "ours_trainer_compiled_nofsdp with the flash_attn4 attention backend",
    # auto takes FA4 where it is installed, so the cuDNN side of the pair is forced by name
    "ours_trainer_compiled_nofsdp_cudnn": "ours_trainer_compiled_nofsdp with the sdpa_cudnn attention backend",
    # the MoE shape's best path (master weights) with each attention by name: FA4 against cuDNN in one run
    "ours_trainer_compiled_nofsdp_master_cudnn": "ours_trainer_compiled_nofsdp_master with the sdpa_cudnn"
    " attention backend",
    "ours_trainer_compiled_nofsdp_master_fa4": "ours_trainer_compiled_nofsdp_master with the flash_attn4 attention"
    " backend",
    "hf_trainer_compiled_nofsdp_master_fa4": "hf_trainer_compiled_nofsdp_master with the flash_attn4 attention"
    " backend (the adapter routes transformers' attention to ours)",
    # FA4 launched from graphs, not through the CuTe DSL's Python runtime: 1.00x the same without graphs
    # (docs/benchmarks.md, run U3), so the GPU's waits before FA4's forward kernel were not the host's launch cost
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
