#!/usr/bin/env bash
# README.md's speed table, measured again on one H100 80 GB in two calls of at most ten minutes each: the commands
# of docs/benchmarks.md's runs U1, U2, U8, U17 and U18, each path against the plain recipe (and torchtitan) of its own run.
#
# Here, once, with network (into the ignored .whl/): torchtitan 0.2.2 and torchao 0.18.0 (.whl/titan, .whl/ao18,
# ~5 MiB) and FlashAttention 4's wheels cut into two parts a call can carry (.whl/fa4_part1, .whl/fa4_part2;
# benchmarks/carry_fa4.py prepare, ~7 minutes of xz):
#   benchmarks/reproduce_readme.sh fetch
# There, two calls back to back on one warm machine (call 2 finds the FlashAttention 4 part that call 1 stashed;
# a fresh machine between them means starting again at call 1):
#   OUT=$OUT benchmarks/reproduce_readme.sh 1   carry .whl/titan .whl/ao18 .whl/fa4_part1   (~9 min)
#       Qwen3-30B-A3B's layer x 6 at seq 4096 x 2: the plain recipe, torchtitan, ours (U8); LoRA at Qwen3-8B's
#       shape: transformers + peft + FSDP2 + compile against ours (U17); the full fine-tune at Qwen3-1.7B's (U18)
#   OUT=$OUT benchmarks/reproduce_readme.sh 2   carry .whl/titan .whl/ao18 .whl/fa4_part2   (~8 min)
#       installs FlashAttention 4, then Qwen3-0.6B at seq 4096 x 4: the plain recipe, torchtitan, ours with cuDNN
#       and with FA4 (U1); the Qwen3-MoE shape: the plain recipe, ours and your transformers MoE (U2); the table
#   OUT=$OUT benchmarks/reproduce_readme.sh table   the table's rows from what $OUT holds
# ENV_ONLY=1 stops each call after installing what it carries (a minute: checks the wheels before the runs).
# Exits non-zero when a run fails or a path's final loss leaves the 2 % band of its baseline's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/readme}
PYTHON=${PYTHON:-python3}

fetch() {
  local pip=("$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
  "${pip[@]}" -d .whl/titan torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 \
    typeguard==4.6.1 shtab==1.13.0 tomli==2.5.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 || return 1
  "${pip[@]}" -d .whl/ao18 torchao==0.18.0 || return 1
  "${pip[@]}" -d .whl/fa4 flash-attn-4==4.0.0b40 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 || return 1
  "$PYTHON" benchmarks/carry_fa4.py prepare
}

# torchtitan and torchao in a folder of their own (flash-attn 2's build, if any, owns /tmp/site)
titan_env() {
  export PYTHONPATH="/tmp/site2:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import torchtitan" 2>/dev/null && return 0
  python3 -m pip install -q --no-index --no-deps --target /tmp/site2 .whl/ao18/*.whl .whl/titan/*.whl \
    && python3 -c "import torchtitan" \
    || { echo "torchtitan does not import: carry .whl/titan and .whl/ao18 (fetch makes them)" >&2; return 1; }
}

# FlashAttention 4 from both carried parts, its compiled kernels cached on disk for every process (as h200_runs.sh)
fa4_env() {
  python3 benchmarks/carry_fa4.py install || return 1
  export PYTHONPATH="$(python3 benchmarks/carry_fa4.py pythonpath):$PYTHONPATH" LIGHTNING_D9D_REQUIRE_FA4=1 \
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$PWD/.fa4_site/jit_cache"
}

call1() {
  local status=0 rc
  python3 benchmarks/carry_fa4.py install
  rc=$?  # 3: this call's part is stashed and the other is still to come, as it should be here
  [[ $rc = 3 || $rc = 0 ]] || { echo "FlashAttention 4 part 1 not stashed (carry .whl/fa4_part1)" >&2; status=1; }
  titan_env || return 1
  [[ ${ENV_ONLY:-} ]] && { python3 -c "import torchtitan, torchao; print('torchtitan and torchao import')"; return $status; }
  MOE_LARGE_BATCH=2 MOE_LARGE_PATHS=hf_fsdp_compiled,titan_compiled,ours_trainer_compiled_nofsdp \
    OUT="$OUT" benchmarks/h200_runs.sh moe_large lora full1.7b || status=1
  return $status
}

call2() {
  local status=0
  titan_env && fa4_env || return 1
  [[ ${ENV_ONLY:-} ]] && { python3 -c "import torchtitan, flash_attn.cute; print('torchtitan and FA4 import')"; return 0; }
  python3 benchmarks/train_throughput.py --compile-threads 16 --matmul-peak --seq-len 4096 --batch-size 4 \
    --steps 30 --path-timeout 200 --out "$OUT/dense" \
    --paths hf_fsdp_compiled,titan_compiled,ours_trainer_compiled_nofsdp_cudnn,ours_trainer_compiled_nofsdp_fa4 \
    || status=1
  OUT="$OUT" benchmarks/h200_runs.sh moe_fa4 || status=1
  table || status=1
  return $status
}

# One line a README row: the path's median step against the baseline's (and torchtitan's) in the same run.
table() {
  python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
ROWS = [  # (result file under $OUT, README row, our path, the baseline, the peer or None)
    ("dense/train_throughput.json", "Qwen3-0.6B, 4096 x 4, FA4", "ours_trainer_compiled_nofsdp_fa4",
     "hf_fsdp_compiled", "titan_compiled"),
    ("moe_fa4/train_throughput.json", "Qwen3-MoE, 4096 x 4, master weights, FA4",
     "ours_trainer_compiled_nofsdp_master_fa4", "hf_fsdp_compiled", None),
    ("moe_fa4/train_throughput.json", "the same MoE as your transformers model",
     "hf_trainer_compiled_nofsdp_master_fa4", "hf_fsdp_compiled", None),
    ("moe_large/train_throughput.json", "Qwen3-30B-A3B layer x 6, 4096 x 2", "ours_trainer_compiled_nofsdp",
     "hf_fsdp_compiled", "titan_compiled"),
    ("lora/8b/lora_throughput.json", "Qwen3-8B LoRA, 4096 x 1", "hf_trainer_lora_compiled_nofsdp",
     "peft_fsdp_compiled", None),
    ("full1.7b/train_throughput.json", "Qwen3-1.7B full fine-tune, 4096 x 2", "ours_trainer_compiled_nofsdp",
     "hf_fsdp_compiled", None),
]
failed = False
print("| row | ours ms | vs plain recipe | vs torchtitan | peak GiB ours / plain | loss vs baseline |")
print("|---|---:|---:|---:|---:|---:|")
for name, row, ours, base, peer in ROWS:
    path = out / name
    if not path.exists():
        print(f"| {row} | missing: {path} | | | | |")
        failed = True
        continue
    results = {r["path"]: r for r in json.loads(path.read_text())["results"] if r.get("ok")}
    if ours not in results or base not in results:
        print(f"| {row} | {ours} or {base} did not finish | | | | |")
        failed = True
        continue
    o, b = results[ours], results[base]
    vs_peer = f"{results[peer]['step_ms']['median'] / o['step_ms']['median']:.2f}x" if peer in results else ""
    loss = o.get("loss_vs_baseline")
    failed |= not o.get("loss_ok", False)
    print(
        f"| {row} | {o['step_ms']['median']:.1f} | {b['step_ms']['median'] / o['step_ms']['median']:.2f}x | "
        f"{vs_peer} | {o['peak_mem_gib']:.1f} / {b['peak_mem_gib']:.1f} | "
        f"{'' if loss is None else f'{100 * loss:+.2f} %'} |"
    )
sys.exit(1 if failed else 0)
EOF
}

case ${1:-} in
  fetch) fetch ;;
  1) call1 ;;
  2) call2 ;;
  table) table ;;
  *) echo "usage: benchmarks/reproduce_readme.sh fetch | 1 | 2 | table" >&2; exit 2 ;;
esac
