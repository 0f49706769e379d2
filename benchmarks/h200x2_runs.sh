#!/usr/bin/env bash
# The two-GPU runs, on one host with two H200s (or H100s), most wanted first. Each throughput part appends
# benchmarks/layouts.py's JSON lines (every step's loss, tokens/s per GPU, each rank's peak memory) to
# $OUT/<part>/layouts.jsonl beside its own one-GPU (or plain) reference, then `compare` holds every row to that
# reference (benchmarks/compare_layouts.py: final loss within 2 %, tokens/s per GPU and peak memory beside it).
# Run parts by name: `benchmarks/h200x2_runs.sh hf layouts fp8`; no argument runs the default list below.
#   hf        transformers' Qwen3 (0.6B shape) under D9DStrategy (layouts.py --impl hf_trainer), compiled, 50
#             steps, seq 4096 x 4: one GPU, tp=2, pp=2 (1F1B, 4 microbatches), cp=2 (torch_ring and
#             all_gather); transformers' Qwen3-MoE at the benchmark shape: one GPU, ep=2 (all-to-all; DeepEP
#             when deep_ep imports: run `deepep` first)
#   layouts   ours on the same layouts as `hf` (and dp_shard=2), 50 steps, seq 4096 x 4, against one GPU
#   moe       our MoE shape on one GPU and at ep=2 (all-to-all; DeepEP's when deep_ep imports), 50 steps
#   fp8       ours at dp_shard=2, seq 4096 x 4 per GPU: bf16, fp8 tensorwise (float8 FSDP all-gather) and
#             rowwise, 30 steps; the reference is the bf16 row; then tp=2 bf16 against tp=2 fp8 tensorwise
#             (torchao's float8 tp styles)
#   asynctp   ours at tp=2, compiled, plain and D9DStrategy(async_tp=True) (micro-pipelined TP), 30 steps; the
#             reference is the plain row
#   save      benchmarks/save_cost.py at dp_shard=2 (torchrun): a save's step-time cost, sync against async
#   scaling   dense 0.6B, compiled, seq 4096 x 4 per GPU: ours and the transformers + FSDP2 + per-layer-compile
#             baseline (layouts.py --impl hf) on one GPU and on dp_shard=2 (target: ours >= 1.97x its one GPU)
#   deepep    builds DeepEP v1.2.1 (intranode, NVSHMEM off, -rdc=true dropped) from the carried source in
#             .fetched/deepep (`git archive v1.2.1` of a fetched DeepEP; never committed), then its GPU test
#             (equal to the all-to-all dispatcher; both dispatch + combine times printed)
#   gpu       every gpu-marked test (the two-GPU ones run here): first tests/gpu/test_two_gpu_layouts_gpu.py
#             (transformers' Qwen3 / Qwen3-MoE at tp=2, cp=2, pp=2, ep=2 and FP8 dp_shard=2 against one GPU; each
#             layout's differences printed to $OUT/gpu/two_gpu_layouts.log), then the rest
# fp8 and gpu install torchao from the carried wheel (.whl/ao18, benchmarks/README.md's FP8 section) into /tmp/site
# where it does not import.
# Every run is bounded (`timeout`: RUN_TIMEOUT, 420 s). Exits non-zero when any run or comparison failed.
# CPU dry run of the whole script (gloo, 2 processes; the numbers mean nothing; CUDA-only runs print a skip):
#   LAYOUT_ARGS="--device cpu --seq-len 32" DENSE_ARGS="--model tiny" MOE_ARGS="--model moe_tiny" \
#     SAVE_ARGS="--device cpu --model tiny --seq-len 32" PYTHON=.venv/bin/python benchmarks/h200x2_runs.sh \
#     hf layouts moe fp8 asynctp save scaling
# (LAYOUT_ARGS is appended last, so it wins.) The dense rows of `hf` and `layouts` untie the head (--untied), so
# that pp=2 (which needs it) is the same model as its one-GPU reference.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
OUT=${OUT:-runs/h200x2}
PY=${PYTHON:-python3}
DENSE=${DENSE_ARGS:-}  # the dense rows' model (0.6b by default); "--model tiny" for a CPU dry run
MOE=${MOE_ARGS:---model moe}
LONG="--steps 50 --warmup 5"  # the loss band is held after 50 steps
status=0
layout() {  # layout <part> <gpus> <layouts.py arguments...>
  local part=$1 gpus=$2; shift 2
  mkdir -p "$OUT/$part"
  echo "[$part] $gpus GPU(s): $*" >&2
  timeout "${RUN_TIMEOUT:-420}" $PY -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
    benchmarks/layouts.py --seq-len 4096 "$@" ${LAYOUT_ARGS:-} \
    2>>"$OUT/$part/stderr.log" | tail -1 | tee -a "$OUT/$part/layouts.jsonl" || status=1
}
compare() {  # compare <part>: every row against its reference, the loss band held
  $PY benchmarks/compare_layouts.py "$OUT/$1/layouts.jsonl" | tee "$OUT/$1/compare.txt" || status=1
}
carried_torchao() {  # torchao for the FP8 rows and tests: the carried wheel, where torchao does not import
  $PY -c "import torchao" 2>/dev/null && return
  if ls .whl/ao18/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/ao18/*.whl \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "torchao does not import and no .whl/ao18 was carried (benchmarks/README.md, FP8)" >&2
  fi
}
deepep_rows() {  # deepep_rows <part> <layouts.py arguments...>: the DeepEP row where deep_ep imports (or on CPU)
  local part=$1; shift
  if $PY -c "import deep_ep" 2>/dev/null || [[ "${LAYOUT_ARGS:-}" == *"--device cpu"* ]]; then
    layout "$part" 2 "$@" --ep 2 --dispatcher deepep
  else
    echo "[$part] DeepEP row skipped: deep_ep does not import (run the deepep part first)" >&2
  fi
}
for part in "${@:-hf layouts fp8 asynctp save scaling moe}"; do
  for name in $part; do
    case $name in
      hf)
        H="--impl hf_trainer --compile --global-batch 4 $LONG"
        layout hf 1 $H $DENSE --untied
        layout hf 2 $H $DENSE --untied --tp 2
        layout hf 2 $H $DENSE --untied --pp 2 --schedule 1F1B --microbatches 4
        layout hf 2 $H $DENSE --untied --cp 2 --context-attention torch_ring
        layout hf 2 $H $DENSE --untied --cp 2 --context-attention all_gather
        layout hf 1 $H $MOE
        layout hf 2 $H $MOE --ep 2
        deepep_rows hf $H $MOE
        compare hf ;;
      layouts)
        O="--compile --global-batch 4 $LONG $DENSE --untied"
        layout layouts 1 $O
        layout layouts 2 $O --dp-shard 2
        layout layouts 2 $O --tp 2
        layout layouts 2 $O --pp 2 --schedule 1F1B --microbatches 4
        layout layouts 2 $O --cp 2 --context-attention torch_ring
        layout layouts 2 $O --cp 2 --context-attention all_gather
        compare layouts ;;
      moe)
        layout moe 1 $MOE --compile --global-batch 4 $LONG
        layout moe 2 $MOE --compile --global-batch 4 $LONG --ep 2
        deepep_rows moe $MOE --compile --global-batch 4 $LONG
        compare moe ;;
      fp8)
        carried_torchao
        F="--compile --global-batch 8 --dp-shard 2 --steps 30 --warmup 5 $DENSE"
        layout fp8 2 $F
        layout fp8 2 $F --fp8 tensorwise
        layout fp8 2 $F --fp8 rowwise
        T="--compile --global-batch 4 --tp 2 --steps 30 --warmup 5 $DENSE"  # tensorwise under tp (float8 styles)
        layout fp8 2 $T
        layout fp8 2 $T --fp8 tensorwise
        compare fp8 ;;
      asynctp)
        A="--compile --global-batch 4 --tp 2 --steps 30 --warmup 5 $DENSE"
        layout asynctp 2 $A
        layout asynctp 2 $A --async-tp
        compare asynctp ;;
      save)
        mkdir -p "$OUT/save"
        timeout "${SAVE_TIMEOUT:-600}" $PY benchmarks/save_cost.py --devices 2 --out "$OUT/save/save_cost.json" \
          --dir /tmp/save_cost ${SAVE_ARGS:-} 2>"$OUT/save/stderr.log" | tee "$OUT/save/stdout.log" || status=1 ;;
      scaling)
        layout scaling 1 --compile --global-batch 4 $DENSE
        layout scaling 2 --compile --global-batch 8 --dp-shard 2 $DENSE
        layout scaling 1 --compile --global-batch 4 --impl hf $DENSE
        layout scaling 2 --compile --global-batch 8 --impl hf $DENSE
        compare scaling ;;
      deepep)
        mkdir -p "$OUT/deepep"
        if [ ! -f .fetched/deepep/setup.py ]; then
          echo "deepep: no source in .fetched/deepep (carry a git archive of DeepEP v1.2.1 there)" >&2; status=1; continue
        fi
        # -rdc=true needs NVSHMEM's device library at link time; without NVSHMEM the intranode kernels do not
        sed -i "s/nvcc_flags.extend(\['-rdc=true', /nvcc_flags.extend([/" .fetched/deepep/setup.py
        (cd .fetched/deepep && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 timeout 900 $PY setup.py build_ext --inplace) \
          >"$OUT/deepep/build.log" 2>&1 || { echo "deepep: build failed (build.log)" >&2; status=1; continue; }
        export PYTHONPATH="$PYTHONPATH:$PWD/.fetched/deepep"
        timeout 600 $PY -m pytest -q -s -m gpu tests/gpu/test_deepep_gpu.py -p no:cacheprovider 2>&1 \
          | tee "$OUT/deepep/tests.log" | tail -30 || status=1 ;;
      gpu)
        mkdir -p "$OUT/gpu"
        carried_torchao
        L=tests/gpu/test_two_gpu_layouts_gpu.py  # -s: each layout's measured differences and losses
        timeout 900 $PY -m pytest -q -s -rs -m gpu $L -p no:cacheprovider 2>&1 | tee "$OUT/gpu/two_gpu_layouts.log" \
          | tail -40 || status=1
        timeout 900 $PY -m pytest -q -m gpu tests --ignore=$L -p no:cacheprovider 2>&1 | tee "$OUT/gpu/tests.log" \
          | tail -5 || status=1 ;;
      *) echo "unknown part $name" >&2; exit 2 ;;
    esac
  done
done
exit $status
