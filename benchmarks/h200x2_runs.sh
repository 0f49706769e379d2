#!/usr/bin/env bash
# The two-GPU runs of the two-GPU issue, for one `nvidia-h200-x2` lease, most wanted first (each part appends
# JSON lines from benchmarks/layouts.py to $OUT/<part>/layouts.jsonl; run parts by name:
# `benchmarks/h200x2_runs.sh scaling layouts`):
#   scaling  dense 0.6B, compiled, seq 4096 x 4 per GPU: ours and the transformers + FSDP2 + per-layer-compile
#            baseline (layouts.py --impl hf) on one GPU and on dp_shard=2 (target: ours >= 1.97x its one GPU)
#   layouts  the same shape on two GPUs, bf16, compiled: tp=2, cp=2 (torch's ring kernels and our portable
#            all-gather path), pp=2 (1F1B, 8 microbatches), beside dp_shard=2
#   moe      the MoE shape on one GPU and at ep=2 (all-to-all dispatcher; DeepEP's when deep_ep imports)
#   deepep   builds DeepEP v1.2.1 (intranode, NVSHMEM off, -rdc=true dropped) from the carried source in
#            .fetched/deepep (`git archive v1.2.1` of a fetched DeepEP; never committed), then its GPU test
#            (equal to the all-to-all dispatcher; both dispatch + combine times printed)
#   gpu      every gpu-marked test (the two-GPU ones run here)
# Run `deepep` before `moe` for the DeepEP row. Exits non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
OUT=${OUT:-runs/h200x2}
PY=${PYTHON:-python3}
status=0
layout() {  # layout <part> <gpus> <layouts.py arguments...>
  local part=$1 gpus=$2; shift 2
  mkdir -p "$OUT/$part"
  # LAYOUT_ARGS (appended last, so it wins): e.g. "--device cpu --model tiny --seq-len 32" for a CPU dry run
  timeout 420 $PY -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/layouts.py --seq-len 4096 "$@" ${LAYOUT_ARGS:-} \
    2>>"$OUT/$part/stderr.log" | tail -1 | tee -a "$OUT/$part/layouts.jsonl" || status=1
}
for part in "${@:-scaling layouts moe}"; do
  for name in $part; do
    case $name in
      scaling)
        layout scaling 1 --compile --global-batch 4
        layout scaling 2 --compile --global-batch 8 --dp-shard 2
        layout scaling 1 --compile --global-batch 4 --impl hf
        layout scaling 2 --compile --global-batch 8 --impl hf ;;
      layouts)
        layout layouts 2 --compile --global-batch 8 --dp-shard 2
        layout layouts 2 --compile --global-batch 8 --tp 2
        layout layouts 2 --compile --global-batch 8 --cp 2 --context-attention torch_ring
        layout layouts 2 --compile --global-batch 8 --cp 2 --context-attention all_gather
        layout layouts 2 --compile --global-batch 8 --pp 2 --schedule 1F1B --microbatches 8 ;;
      moe)
        layout moe 1 --model moe --compile --global-batch 4
        layout moe 2 --model moe --compile --global-batch 8 --ep 2
        if $PY -c "import deep_ep" 2>/dev/null; then
          layout moe 2 --model moe --compile --global-batch 8 --ep 2 --dispatcher deepep
        fi ;;
      deepep)
        mkdir -p "$OUT/deepep"
        if [ ! -f .fetched/deepep/setup.py ]; then
          echo "deepep: no source in .fetched/deepep (carry a git archive of DeepEP v1.2.1 there)" >&2; status=1; continue
        fi
        # -rdc=true needs NVSHMEM's device library at link time; without NVSHMEM the intranode kernels do not
        sed -i "s/nvcc_flags.extend(\['-rdc=true', /nvcc_flags.extend([/" .fetched/deepep/setup.py
        (cd .fetched/deepep && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 $PY setup.py build_ext --inplace) \
          >"$OUT/deepep/build.log" 2>&1 || { echo "deepep: build failed (build.log)" >&2; status=1; continue; }
        export PYTHONPATH="$PYTHONPATH:$PWD/.fetched/deepep"
        $PY -m pytest -q -s -m gpu tests/gpu/test_deepep_gpu.py -p no:cacheprovider 2>&1 \
          | tee "$OUT/deepep/tests.log" | tail -30 || status=1 ;;
      gpu)
        mkdir -p "$OUT/gpu"
        $PY -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu/tests.log" | tail -5 || status=1 ;;
      *) echo "unknown part $name" >&2; exit 2 ;;
    esac
  done
done
exit $status
