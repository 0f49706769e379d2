#!/usr/bin/env bash
# Build the optional kernel packages our backend registries name, from source, for sm_90 only:
#   grouped_gemm (tgale96's CUTLASS grouped GEMM; lightning_d9d/kernels/grouped_gemm.py's "grouped_gemm" backend)
#   flash_attn   (FlashAttention 2, bf16 + head dim 128 only; lightning_d9d/modules/attention.py's "flash_attn")
#
#   benchmarks/build_kernels.sh [grouped_gemm] [flash_attn]   # default: both, in parallel
#   benchmarks/build_kernels.sh fetch                         # needs PyPI, nvcc and a (CPU) torch; see README
#
# Sources come from $FETCHED (default .fetched/ in the repo root: git-ignored, carried to a GPU host without a
# network); a package whose source is absent is skipped with a message. Each build works on a copy under $BUILD_DIR
# (default /tmp/d9d_kernel_build), installs into $SITE (default /tmp/site: use it with PYTHONPATH=$SITE:.),
# prints its wall time, and leaves its log beside the copy. Exit status: non-zero if any selected build that
# had its source failed. benchmarks/README.md ("Optional kernels built from source") says what is trimmed and why.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FETCHED="${FETCHED:-$ROOT/.fetched}"
BUILD_DIR="${BUILD_DIR:-/tmp/d9d_kernel_build}"
SITE="${SITE:-/tmp/site}"
PYTHON="${PYTHON:-python3}"
JOBS="${MAX_JOBS:-16}"
FLASH_ATTN_VERSION="${FLASH_ATTN_VERSION:-2.8.3}"
GROUPED_GEMM_VERSION="${GROUPED_GEMM_VERSION:-0.3.0}"

say() { printf '[build_kernels] %s\n' "$*"; }
die() { say "ERROR: $*"; exit 1; }

source_of() {  # the fetched source folder of a package ($1: a glob under $FETCHED), or nothing
    local found
    for found in "$FETCHED"/$1; do
        [[ -f "$found/setup.py" ]] && { echo "$found"; return; }
    done
}

find_cuda_home() {  # $CUDA_HOME, else where nvcc says it lives (it may be a wrapper script on PATH)
    if [[ -n "${CUDA_HOME:-}" ]]; then echo "$CUDA_HOME"; return; fi
    local top
    top="$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
    if [[ -n "$top" ]]; then (cd "$top" && pwd); elif [[ -x /usr/local/cuda/bin/nvcc ]]; then echo /usr/local/cuda; fi
}

# torch's extension builder adds $CUDA_HOME/include only; the CUDA libraries' headers that torch's own headers
# include (cusparse.h, cublas_v2.h, cusolverDn.h) may instead be in pip's nvidia-* packages: add those to CPATH
# (searched after every -I, so the toolkit's own headers still win).
cuda_env() {
    CUDA_HOME="$(find_cuda_home)"
    [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]] || die "no nvcc: set CUDA_HOME or put nvcc on PATH"
    export CUDA_HOME
    say "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -n 2 | head -n 1) ($CUDA_HOME)"
    local torch_version
    torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')" ||
        die "$PYTHON cannot import torch (set PYTHON to the interpreter that has the CUDA torch)"
    say "torch: $torch_version"
    if [[ ! -f "$CUDA_HOME/include/cusparse.h" || ! -f "$CUDA_HOME/include/cublas_v2.h" ]]; then
        local extra
        extra="$("$PYTHON" - <<'EOF'
import glob, os, sys
dirs = []
for base in sys.path:
    for d in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include"))):
        if any(os.path.exists(os.path.join(d, h)) for h in ("cusparse.h", "cublas_v2.h", "cusolverDn.h")):
            dirs.append(d)
print(":".join(dict.fromkeys(dirs)))
EOF
)"
        if [[ -n "$extra" ]]; then
            export CPATH="${extra}${CPATH:+:$CPATH}"
            say "CPATH += $extra"
        else
            say "warning: no cusparse.h/cublas_v2.h under $CUDA_HOME/include nor in pip's nvidia-*: the build may fail"
        fi
    fi
    export TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="$JOBS"
}

pip_build() {  # $1 name, $2 build copy; the environment carries the package's own switches
    local name="$1" work="$2" start rc
    start=$(date +%s)
    (cd "$work" && "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index --upgrade \
        --target "$SITE" -v . >"$BUILD_DIR/$name.log" 2>&1)
    rc=$?
    local took=$(($(date +%s) - start))
    if ((rc != 0)); then
        say "FAILED: $name after ${took} s (exit $rc); last lines of $BUILD_DIR/$name.log:"
        grep -E -i "error|fatal" "$BUILD_DIR/$name.log" | head -n 20
        tail -n 25 "$BUILD_DIR/$name.log"
        return 1
    fi
    say "built $name in ${took} s wall -> $SITE"
}

build_grouped_gemm() {
    local src
    src="$(source_of 'grouped_gemm*')"
    [[ -n "$src" ]] || { say "skip grouped_gemm: no $FETCHED/grouped_gemm*/setup.py"; return 0; }
    rm -rf "$BUILD_DIR/grouped_gemm" && cp -a "$src" "$BUILD_DIR/grouped_gemm" || return 1
    # GROUPED_GEMM_CUTLASS=1: the CUTLASS grouped kernel (one launch for all experts); without it the package
    # loops cuBLAS GEMMs per expert on the host. TORCH_CUDA_ARCH_LIST (set) keeps its setup.py from asking
    # the GPU for its capability and builds sm_90 alone.
    say "building grouped_gemm from $src (CUTLASS mode, sm_90)"
    GROUPED_GEMM_CUTLASS=1 pip_build grouped_gemm "$BUILD_DIR/grouped_gemm"
}

build_flash_attn() {
    local src
    src="$(source_of 'flash[-_]attn-*')"
    [[ -n "$src" ]] || { say "skip flash_attn: no $FETCHED/flash_attn-*/setup.py"; return 0; }
    rm -rf "$BUILD_DIR/flash_attn" && cp -a "$src" "$BUILD_DIR/flash_attn" || return 1
    "$PYTHON" "$ROOT/benchmarks/kernel_sources.py" patch-flash-attn "$BUILD_DIR/flash_attn" || {
        say "FAILED: flash_attn: the bf16/head-dim-128 patch did not apply"
        return 1
    }
    say "building flash_attn from $src (bf16, head dim 128, sm_90; 6 kernel files + flash_api.cpp)"
    # FORCE_BUILD: never try to download a prebuilt wheel (no network there); CUDA_ARCHS=90: sm_90 alone;
    # NVCC_THREADS=1: nvcc's threads split gencode targets, of which there is one.
    FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=FALSE FLASH_ATTN_CUDA_ARCHS=90 \
        BUILD_TARGET=cuda NVCC_THREADS=1 pip_build flash_attn "$BUILD_DIR/flash_attn"
}

fetch() {  # on a machine with PyPI, nvcc and a torch (CPU is enough): sdists into $FETCHED, trimmed
    local tmp
    tmp="$(mktemp -d)"
    mkdir -p "$FETCHED" "$tmp/shim/c10/cuda/impl"
    # pip download prepares metadata, which runs setup.py: grouped_gemm's asks torch for CUDA_HOME, which a CPU
    # torch does not set; this shim (only for that step) says where nvcc is.
    cat >"$tmp/shim/sitecustomize.py" <<EOF
import torch.utils.cpp_extension as _ce
_ce.CUDA_HOME = _ce.CUDA_HOME or "$CUDA_HOME"
EOF
    local common=(-m pip download --no-deps --no-binary=:all: --no-build-isolation -d "$tmp")
    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$PYTHON" "${common[@]}" "flash-attn==$FLASH_ATTN_VERSION" || die "fetch flash-attn"
    TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH="$tmp/shim" "$PYTHON" "${common[@]}" "grouped_gemm==$GROUPED_GEMM_VERSION" ||
        die "fetch grouped_gemm"
    tar xzf "$tmp/flash_attn-$FLASH_ATTN_VERSION.tar.gz" -C "$tmp" && tar xzf "$tmp/grouped_gemm-$GROUPED_GEMM_VERSION.tar.gz" -C "$tmp" ||
        die "unpack"
    local fa="$tmp/flash_attn-$FLASH_ATTN_VERSION" gg="$tmp/grouped_gemm-$GROUPED_GEMM_VERSION"
    [[ -f "$fa/csrc/cutlass/include/cutlass/cutlass.h" ]] || die "flash-attn's sdist lacks csrc/cutlass"
    [[ -f "$gg/third_party/cutlass/include/cutlass/cutlass.h" ]] || die "grouped_gemm's sdist lacks third_party/cutlass"
    # Headers the kept sources open (preprocessing only: torch's CUDA headers' own includes may be empty stubs).
    local torch_inc
    torch_inc="$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
    # a CPU torch lacks a generated c10 header; the toolkit here may lack the CUDA libraries' headers
    local h
    for h in c10/cuda/impl/cuda_cmake_macros.h $(grep -rhoE '#include <(cu|nv)[A-Za-z_0-9]+\.h>' "$torch_inc/ATen/cuda" "$torch_inc/c10/cuda" |
        sed -E 's/.*<(.*)>/\1/' | sort -u); do
        [[ -f "$CUDA_HOME/include/$h" || -f "$tmp/shim/$h" ]] || : >"$tmp/shim/$h"
    done
    local inc=(-I"$tmp/shim" -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I"$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
    local disable=(-DFLASHATTENTION_DISABLE_DROPOUT -DFLASHATTENTION_DISABLE_ALIBI -DFLASHATTENTION_DISABLE_SOFTCAP
        -DFLASHATTENTION_DISABLE_LOCAL -DFLASHATTENTION_DISABLE_UNEVEN_K)
    cp -a "$fa" "$tmp/fa_patched" && "$PYTHON" "$ROOT/benchmarks/kernel_sources.py" patch-flash-attn "$tmp/fa_patched" || die "patch"
    (cd "$tmp/fa_patched" && for f in csrc/flash_attn/src/*.cu; do
        nvcc -M -std=c++17 --expt-relaxed-constexpr --expt-extended-lambda -gencode arch=compute_90,code=sm_90 \
            -Icsrc/flash_attn -Icsrc/flash_attn/src -Icsrc/cutlass/include "${inc[@]}" "${disable[@]}" "$f" || exit 1
    done && g++ -M -std=c++17 -Icsrc/flash_attn -Icsrc/flash_attn/src -Icsrc/cutlass/include -I"$CUDA_HOME/include" \
        "${inc[@]}" "${disable[@]}" csrc/flash_attn/flash_api.cpp) >"$tmp/fa.deps" || die "nvcc -M flash-attn"
    (cd "$gg" && for f in csrc/*.cu; do for mode in -DGROUPED_GEMM_CUTLASS -UGROUPED_GEMM_CUTLASS; do
        nvcc -M -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 $mode \
            -Ithird_party/cutlass/include -Icsrc "${inc[@]}" "$f" || exit 1
    done; done) >"$tmp/gg.deps" || die "nvcc -M grouped_gemm"
    "$PYTHON" "$ROOT/benchmarks/kernel_sources.py" trim-flash-attn "$fa" --deps "$tmp/fa.deps" || die "trim flash-attn"
    "$PYTHON" "$ROOT/benchmarks/kernel_sources.py" trim-grouped-gemm "$gg" --deps "$tmp/gg.deps" || die "trim grouped_gemm"
    rm -rf "$FETCHED/flash_attn-$FLASH_ATTN_VERSION" "$FETCHED/grouped_gemm-$GROUPED_GEMM_VERSION"
    mv "$fa" "$gg" "$FETCHED/" && rm -rf "$tmp"
    say "fetched into $FETCHED: $(du -sh --apparent-size "$FETCHED" | cut -f1) in all"
}

parts=("$@")
((${#parts[@]})) || parts=(grouped_gemm flash_attn)
for part in "${parts[@]}"; do
    case "$part" in
    fetch)
        CUDA_HOME="$(find_cuda_home)" && [[ -n "$CUDA_HOME" ]] || die "no nvcc: set CUDA_HOME or put nvcc on PATH"
        fetch
        exit $?
        ;;
    grouped_gemm | flash_attn) ;;
    *) die "unknown part '$part': choose grouped_gemm, flash_attn (or fetch)" ;;
    esac
done

present=()
for part in "${parts[@]}"; do
    if [[ "$part" == grouped_gemm && -z "$(source_of 'grouped_gemm*')" ]]; then
        say "skip grouped_gemm: no $FETCHED/grouped_gemm*/setup.py"
    elif [[ "$part" == flash_attn && -z "$(source_of 'flash[-_]attn-*')" ]]; then
        say "skip flash_attn: no $FETCHED/flash_attn-*/setup.py"
    else
        present+=("$part")
    fi
done
((${#present[@]})) || { say "nothing to build"; exit 0; }
parts=("${present[@]}")
mkdir -p "$BUILD_DIR" "$SITE" || die "cannot create $BUILD_DIR or $SITE"
cuda_env
started=$(date +%s)
declare -A pids
for part in "${parts[@]}"; do  # the two builds use 2 and 7 compile jobs: together they fit 16 cores
    "build_$part" &
    pids[$part]=$!
done
failed=()
for part in "${!pids[@]}"; do
    wait "${pids[$part]}" || failed+=("$part")
done
say "all builds done in $(($(date +%s) - started)) s wall"
((${#failed[@]} == 0)) || die "failed: ${failed[*]} (logs in $BUILD_DIR)"
