#!/usr/bin/env bash
# Every layout x activation checkpointing x compile combination trains on CPU (gloo), or fails with its first
# error line: a smoke sweep of benchmarks/layouts.py that found four crashing combinations the parity tests did
# not cover (docs/benchmarks.md has no numbers from it: CPU step times say nothing about GPU speed). About 25
# minutes on 2 cores for the 2-rank part, 20 for the 4-rank part; run a part by name:
#   benchmarks/cpu_layout_sweep.sh two four
# Prints one line per run: model | layout | checkpointing | compile | seconds | ok <last loss> / FAIL <error>.
# Exits non-zero when a run failed that should not (torch's ring attention refuses CPU meshes by design).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
status=0
run() {  # run <ranks> <model> <checkpointing> <compile flag or ""> <layouts.py layout arguments...>
  local ranks=$1 model=$2 ac=$3 compile=$4; shift 4
  local start out line
  start=$(date +%s)
  out=$(timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" benchmarks/layouts.py \
    --device cpu --model "$model" "$@" $compile --activation-checkpointing "$ac" --seq-len 32 \
    --global-batch $((2 * ranks)) --steps 3 --warmup 1 2>&1)
  line=$(echo "$out" | grep '^{"impl"' | tail -1)
  if [ -n "$line" ]; then
    line="ok $(echo "$line" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["last_loss"])')"
  else
    line="FAIL $(echo "$out" | grep -E '^\[rank[0-9]+\]: [A-Za-z_.]*(Error|Exception)' | grep -v 'DataLoader\|gloo' \
      | head -1 | cut -c1-300)"
    status=1
  fi
  echo "$model | $* | ac=$ac | $([ -n "$compile" ] && echo compiled || echo eager) | $(( $(date +%s) - start ))s | $line"
}
for part in "${@:-two four}"; do
  case $part in
    two)
      for model in moe_tiny tiny; do
        for layout in "--tp 2" "--cp 2" "--ep 2" "--pp 2 --microbatches 2" "--dp-shard 2"; do
          [ "$model" = tiny ] && [ "$layout" = "--ep 2" ] && continue
          for ac in off selective full; do
            # shellcheck disable=SC2086  # the layout is several arguments
            run 2 $model $ac --compile $layout
          done
        done
      done ;;
    four)
      for layout in "--tp 2 --ep 2 --dp-shard 2" "--pp 2 --ep 2 --dp-shard 2 --microbatches 2" \
          "--cp 2 --ep 2 --dp-shard 2" "--dp-replicate 2 --dp-shard 2 --ep 2" "--pp 2 --tp 2 --microbatches 2" \
          "--cp 2 --tp 2"; do
        for ac in off selective full; do
          # pp x ep with selective recompute is refused by the strategy (plans/checkpointing.py)
          [ "$ac" = selective ] && [[ "$layout" == --pp*--ep* ]] && continue
          # shellcheck disable=SC2086
          run 4 moe_tiny $ac --compile $layout
        done
      done ;;
    *) echo "unknown part $part (two, four)" >&2; exit 2 ;;
  esac
done
exit $status
