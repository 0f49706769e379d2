#!/usr/bin/env bash
# The one-GPU measurements docs/benchmarks.md reports, one part a command (each part writes under $OUT/<part>;
# run parts by name: `benchmarks/h200_runs.sh dense moe`; benchmarks/reproduce_readme.sh runs README.md's table).
#   dense    the 0.6B shape: baseline, torchtitan (when its wheels are on PYTHONPATH), ours, transformers' model
#            under the Trainer (hf_trainer_compiled), and ours' levers (the last path: without the
#            GarbageCollection callback)
#   moe      the MoE shape: baseline, ours, transformers' model under the Trainer, ours without FSDP on the one
#            rank
#   long     dense at seq 16,384 and 32,768, batch 1: baseline vs ours, with and without FSDP on the one rank
#   kernels  benchmarks/kernel_speed.py (all parts; liger-kernel / cut-cross-entropy beside ours when their wheels are
#            installed: benchmarks/README.md)
#   permute  the MoE permutation's gather against a token-major candidate (benchmarks/permute_candidates.py, ~1 min)
#   gpu      the gpu-marked tests
#   ladder4b, ladder1.7b  the scale ladder at Qwen3's 4B / 1.7B shapes: the plain recipe, torchtitan
#            bf16 and FP8 rowwise (its supported recipe), ours (no FSDP on the one rank: its best fit) bf16 and
#            FP8 tensorwise; seq 4096 x 4, 4 + 12 steps (each path compiles once per shape)
#   moe_large  Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8) at 6 layers (MOE_LARGE_LAYERS
#            and MOE_LARGE_BATCH: fewer, for an 80 GB card): the plain recipe, torchtitan's MoE at that shape, ours
#            with and without FSDP on the one rank (MOE_LARGE_PATHS overrides the list)
#   half4b   Qwen3-4B's layer at 18 of its 36 layers (fits an 80 GB card): torchtitan bf16, ours without and with
#            FSDP on the one rank and with selective recompute (the 4B memory levers against torchtitan's peak),
#            then a profile of our compiled step (benchmarks/profile_step.py)
#   moe_profile  benchmarks/profile_step.py on our MoE shape (our model compiled, no FSDP, master weights: the best
#            path; MOE_PROFILE_ARGS=" " profiles fused AdamW on fp32 parameters instead), for the
#            MoE target's table of where the step goes (~2 min)
#   titan06  the 0.6B shape in one run: the plain recipe, torchtitan, ours with and without FSDP on the one rank
#   whole4b  Qwen3-4B's whole shape (H200 only: ~130 GiB): torchtitan bf16, ours without FSDP on the one rank and
#            with FSDP freeing its gathered parameters after forward (reshard_after_forward=True), and with
#            MasterWeightAdamW (the same 16 bytes a parameter, but no autocast copies kept for backward: ~7 GB
#            less by count, saved_for_backward.py): under torchtitan's peak?
#   moe_ab   the MoE shape, a change against the code before it on one machine: the plain recipe and ours (no FSDP on
#            the one rank) on this tree, then ours on the snapshot in $BASE (default runs/base: another commit's
#            package and examples, `git archive <commit> lightning_d9d examples | tar -x -C runs/base`, carried)
#            (~6 min)
#   master   MasterWeightAdamW (bf16 parameters, fp32 masters in the optimizer): its gpu tests, then the MoE shape
#            (MASTER_MODEL / MASTER_ARGS: another, e.g. 4b and "--layers 18 --path-timeout 240") with the plain
#            recipe, ours without FSDP on the one rank, and the same with master weights (~5 min)
#   moe_fp8  the MoE shape: the plain recipe, ours bf16, FP8 rowwise with the experts in FP8 (fp8_experts=None:
#            where the GPU and torchao allow) and with them in bf16 (MOE_FP8_PATHS overrides the list)
#   cudagraphs  the 0.6B shape: compile="reduce-overhead" (CUDA graph trees per block) against the same without
#            graphs, at seq 4096 x 4 and at a launch-bound seq 1024 x 1
#   moe_cudagraphs  the MoE shape, ours without FSDP with master weights, with and without CUDA graphs, beside the
#            plain recipe, at 1,024, 4,096 and 16,384 tokens a step (~9 min; MOE_CG_SHAPES="4096x4x4x12" picks
#            one: seq x batch x warm-up x steps)
#   hf_moe   a transformers Qwen3-MoE at the MoE shape under the adapter: with FSDP on the one rank, without (its
#            experts on the adapter's own forward) and as CUDA graphs, beside the plain recipe, at
#            4,096 x 4 and 1,024 x 1 tokens (~8 min)
#   fa4      FlashAttention 4, once benchmarks/carry_fa4.py's parts have been carried (benchmarks/README.md,
#            'FlashAttention 4': the calls): install, its gpu tests (a skip is a failure here), the attention rows of
#            kernel_speed.py (cuDNN, FA4, flash-attn on the block's layout) and document_attention_speed.py (~5 min);
#            fa4_tests: its tests only
#   fa4_train  the 0.6B shape, ours without FSDP on the one rank: cuDNN against FA4 in the same run, each by name
#            (auto takes FA4 once it is on the path, which fa4_env puts it on for every later part too) (~5 min)
#   moe_fa4  the MoE shape's best path (no FSDP on the one rank, master weights), ours with cuDNN and with FA4 by
#            name and the transformers MoE under the adapter with FA4, beside the plain recipe; 5 + 40 steps (~5 min)
#   fa4_packed  packed rows of the 0.6B shape: FlexAttention against FA4's varlen kernel (~5 min)
#   built    grouped_gemm and flash-attn 2 built from the carried sources (benchmarks/build_kernels.sh, carry
#            .fetched; ~3 min), their gpu tests (a skip is a failure here) and their kernel_speed.py rows beside
#            what the registries pick today; the built packages stay on the path of this part only
#   hfattn   transformers' Qwen3 on our attention backends (tests/gpu/test_hf_attention_gpu.py), with whatever
#            attention is installed (after fa4_env: FA4)
#   unrun    gpu tests of CUDA graphs, FP8 experts, the transformers packed case, the experts' weighted SwiGLU and
#            the FP8 linears (torchao on the path; ~5 min)
#   lora     LoRA fine-tuning (rank 16 on every projection of the blocks) at Qwen3-8B's shape, seq 4096, random
#            weights: transformers + peft + FSDP2 + per-layer compile against ours through the Trainer (the transformers
#            model, and our white-box one); Qwen3-4B's shape where the baseline runs out of memory
#            (benchmarks/lora_throughput.py; ~6 min on one H100 80 GB)
#   full1.7b the full fine-tune beside it: Qwen3-1.7B's shape at seq 4096 x 2 (the plain recipe's 78.6 GiB at x 4
#            fills an 80 GB card), the plain recipe against ours without FSDP on the one rank (~4 min)
# Every throughput part fails (non-zero) when a path's final loss leaves the 2 % band of the baseline's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
OUT=${OUT:-runs/h200}
# --matmul-peak: MFU also against the bf16 matmul rate measured at the start of the same run
bench() { python3 benchmarks/train_throughput.py --compile-threads 16 --path-timeout 150 --matmul-peak "$@"; }
titan="" titan_fp8=""
python3 -c "import torchtitan" 2>/dev/null && titan="titan_compiled," && titan_fp8="titan_compiled_fp8_rowwise,"
# FlashAttention 4 from the carried parts (exit 3 while a part is missing: carry it in the next call); its compiled
# kernels cached on disk for every process of the part (the gpu tests, the benchmarks' workers)
fa4_env() {
  python3 benchmarks/carry_fa4.py install || return 1
  export PYTHONPATH="$(python3 benchmarks/carry_fa4.py pythonpath):$PYTHONPATH" LIGHTNING_D9D_REQUIRE_FA4=1 \
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$PWD/.fa4_site/jit_cache"
}
status=0
for part in "${@:-dense moe}"; do
  for name in $part; do
    mkdir -p "$OUT/$name"  # (the throughput parts create their own folders too)
    case $name in
      dense) bench --seq-len 4096 --batch-size 4 --out "$OUT/dense" --paths \
          "hf_fsdp_compiled,${titan}ours_trainer_compiled,hf_trainer_compiled,ours_trainer_compiled_selective,ours_trainer_compiled_nofsdp,ours_trainer_compiled_nofsdp_autogc" ;;
      moe) LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe --seq-len 4096 --batch-size 4 --steps 40 \
          --out "$OUT/moe" --paths hf_fsdp_compiled,ours_trainer_compiled,hf_trainer_compiled,ours_trainer_compiled_nofsdp ;;
      long) for seq in 16384 32768; do
          bench --seq-len $seq --batch-size 1 --out "$OUT/long$seq" \
            --paths hf_fsdp_compiled,ours_trainer_compiled,ours_trainer_compiled_nofsdp \
            || status=1
        done ;;
      ladder4b|ladder1.7b) bench --model "${name#ladder}" --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 \
          --path-timeout 240 --out "$OUT/$name" --paths \
          "hf_fsdp_compiled,${titan}${titan_fp8}ours_trainer_compiled_nofsdp,ours_trainer_compiled_nofsdp_fp8_tensorwise" ;;
      half4b) bench --model 4b --layers 18 --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 --path-timeout 200 \
          --out "$OUT/half4b" --paths "${titan}ours_trainer_compiled_nofsdp,ours_trainer_compiled,ours_trainer_compiled_nofsdp_selective" \
          || status=1
        python3 benchmarks/profile_step.py --model 4b --layers 18 --path ours_compiled --out "$OUT/half4b/profile" ;;
      moe_large) LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe_large --seq-len 4096 --batch-size "${MOE_LARGE_BATCH:-4}" \
          --warmup 4 ${MOE_LARGE_LAYERS:+--layers "$MOE_LARGE_LAYERS"} --steps 12 --path-timeout 240 --out "$OUT/moe_large" \
          --paths "${MOE_LARGE_PATHS:-hf_fsdp_compiled,${titan}ours_trainer_compiled,ours_trainer_compiled_nofsdp}" ;;
      moe_profile) LIGHTNING_D9D_GROUPED_GEMM=torch python3 benchmarks/profile_step.py --model moe \
          --path ours_compiled ${MOE_PROFILE_ARGS:---master-weights} --out "$OUT/moe_profile" ;;
      titan06) bench --seq-len 4096 --batch-size 4 --out "$OUT/titan06" \
          --paths "hf_fsdp_compiled,${titan}ours_trainer_compiled,ours_trainer_compiled_nofsdp" ;;
      whole4b) bench --model 4b --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 --path-timeout 240 \
          --out "$OUT/whole4b" --paths "${titan}ours_trainer_compiled_nofsdp,ours_trainer_compiled_reshard,ours_trainer_compiled_nofsdp_master" ;;
      moe_ab) test -d "${BASE:-runs/base}/lightning_d9d" || { echo "moe_ab: no snapshot in ${BASE:-runs/base}" >&2; false; } \
          && LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 \
            --out "$OUT/moe_ab" --paths hf_fsdp_compiled,ours_trainer_compiled_nofsdp \
          && PYTHONPATH="$PWD/${BASE:-runs/base}:$PYTHONPATH" LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe \
            --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 --out "$OUT/moe_ab_base" \
            --paths ours_trainer_compiled_nofsdp ;;
      master) python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_master_weights_gpu.py 2>&1 \
            | tee "$OUT/master/tests.log"; test "${PIPESTATUS[0]}" = 0 \
          && LIGHTNING_D9D_GROUPED_GEMM=torch bench --model "${MASTER_MODEL:-moe}" \
            ${MASTER_ARGS:-} --seq-len 4096 --batch-size 4 --warmup 4 --steps 12 --out "$OUT/master" \
            --paths "${MASTER_PATHS:-hf_fsdp_compiled,ours_trainer_compiled_nofsdp,ours_trainer_compiled_nofsdp_master}" ;;
      moe_fp8) LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe --seq-len 4096 --batch-size 4 --warmup 4 \
          --steps 12 --path-timeout 200 --out "$OUT/moe_fp8" --paths "${MOE_FP8_PATHS:-hf_fsdp_compiled,ours_trainer_compiled_nofsdp,ours_trainer_compiled_nofsdp_fp8_rowwise,ours_trainer_compiled_nofsdp_fp8_rowwise_bf16experts}" ;;
      moe_cudagraphs) for shape in ${MOE_CG_SHAPES:-1024x1x6x20 4096x1x4x16 4096x4x4x12}; do
          IFS=x read -r seq batch warm steps <<<"$shape"
          LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe --seq-len "$seq" --batch-size "$batch" --warmup "$warm" \
            --steps "$steps" --out "$OUT/moe_cudagraphs${seq}x$batch" --paths \
            hf_fsdp_compiled,ours_trainer_compiled_nofsdp_master,ours_trainer_compiled_nofsdp_cudagraphs_master \
            || status=1
        done ;;
      hf_moe) for shape in 4096x4x4x12 1024x1x6x20; do
          IFS=x read -r seq batch warm steps <<<"$shape"
          LIGHTNING_D9D_GROUPED_GEMM=torch bench --model moe --seq-len "$seq" --batch-size "$batch" --warmup "$warm" \
            --steps "$steps" --out "$OUT/hf_moe${seq}x$batch" --paths \
            hf_fsdp_compiled,hf_trainer_compiled,hf_trainer_compiled_nofsdp,hf_trainer_compiled_nofsdp_cudagraphs \
            || status=1
        done ;;
      cudagraphs) for shape in "4096 4" "1024 1"; do
          set -- $shape
          bench --seq-len "$1" --batch-size "$2" --out "$OUT/cudagraphs$1x$2" \
            --paths ours_trainer_compiled_nofsdp,ours_trainer_compiled_nofsdp_cudagraphs || status=1
        done ;;
      lora) python3 benchmarks/lora_throughput.py --compile-threads 16 --matmul-peak --out "$OUT/lora" ;;
      full1.7b) bench --model 1.7b --seq-len 4096 --batch-size 2 --warmup 3 --steps 10 --path-timeout 200 \
          --out "$OUT/full1.7b" --paths hf_fsdp_compiled,ours_trainer_compiled_nofsdp ;;
      kernels) python3 benchmarks/kernel_speed.py --out "$OUT/kernels/kernels.json" ;;
      permute) python3 benchmarks/permute_candidates.py 2>&1 | tee "$OUT/permute/permute.jsonl"; test "${PIPESTATUS[0]}" = 0 ;;
      fa4|fa4_tests) fa4_env && {
          python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_flash_attn4_gpu.py \
            "tests/gpu/test_kernels_gpu.py::test_attention_backends_equal_fp32_attention" \
            "tests/gpu/test_kernels_gpu.py::test_auto_attention_on_hopper_is_fa4_or_cudnn" 2>&1 | tee "$OUT/$name/tests.log"
          test "${PIPESTATUS[0]}" = 0 || status=1
          [[ $name = fa4_tests ]] || python3 benchmarks/kernel_speed.py --only attention --quick --out "$OUT/fa4/kernels.json" || status=1
          [[ $name = fa4_tests ]] || python3 benchmarks/document_attention_speed.py --out "$OUT/fa4"
        } ;;
      moe_fa4) fa4_env && bench --model moe --seq-len 4096 --batch-size 4 --steps 40 --path-timeout 300 \
          --out "$OUT/moe_fa4" --paths "${MOE_FA4_PATHS:-hf_fsdp_compiled,ours_trainer_compiled_nofsdp_master_cudnn,ours_trainer_compiled_nofsdp_master_fa4,hf_trainer_compiled_nofsdp_master_fa4}" ;;
      fa4_train) fa4_env && bench --seq-len 4096 --batch-size 4 --path-timeout 300 --out "$OUT/fa4_train" \
          --paths ours_trainer_compiled_nofsdp_cudnn,ours_trainer_compiled_nofsdp_fa4 ;;
      fa4_packed) fa4_env && python3 benchmarks/packed_throughput.py --out "$OUT/fa4_packed" \
          --paths packed_flex,packed_flash_attn4 ;;
      built) { benchmarks/build_kernels.sh grouped_gemm flash_attn 2>&1 | tee "$OUT/built/build.log"
          test "${PIPESTATUS[0]}" = 0; } && (
          export PYTHONPATH="/tmp/site:$PYTHONPATH" LIGHTNING_D9D_REQUIRE_BUILT=1
          python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
            -k "grouped_gemm or attention" 2>&1 | tee "$OUT/built/tests.log"
          rc=${PIPESTATUS[0]}
          python3 benchmarks/kernel_speed.py --only attention,grouped_gemm --quick --out "$OUT/built/kernels.json" \
            || rc=1
          exit $rc
        ) ;;
      hfattn) python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_hf_attention_gpu.py 2>&1 \
          | tee "$OUT/hfattn/tests.log"; test "${PIPESTATUS[0]}" = 0 ;;
      unrun) python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py \
          tests/gpu/test_fp8_experts_gpu.py tests/gpu/test_packed_gpu.py tests/gpu/test_fp8_gpu.py \
          "tests/gpu/test_kernels_gpu.py::test_weighted_swiglu" 2>&1 \
          | tee "$OUT/unrun/tests.log"; test "${PIPESTATUS[0]}" = 0 ;;
      gpu) python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu/tests.log" ;;
      *) echo "unknown part $name" >&2; exit 2 ;;
    esac || status=1
  done
done
exit $status
