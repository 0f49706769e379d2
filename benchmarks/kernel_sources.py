"""Prepare the optional kernel packages' sources for a short build from source (``benchmarks/build_kernels.sh``).

    python benchmarks/kernel_sources.py trim-flash-attn DIR      # on the fetched copy: drop what no build reads
    python benchmarks/kernel_sources.py trim-grouped-gemm DIR
    python benchmarks/kernel_sources.py patch-flash-attn DIR     # on the build copy: bf16, head dim 128, sm_90

FlashAttention 2's ``setup.py`` compiles 72 kernel files (6 head dims x fp16/bf16 x causal or not x forward /
backward / split-KV forward) for up to four architectures: hours on 16 cores. Our models call
``flash_attn_func(q, k, v, causal=True)`` on bf16 with head dim 128, so the patch keeps the six bf16 head-dim-128
files (forward, backward, split-KV forward; causal and not), makes the dispatch in ``static_switch.h`` instantiate
only those (an fp16 tensor or another head dim is refused with a message instead of an unresolved symbol at
import), and turns on the ``FLASHATTENTION_DISABLE_*`` switches for what that call never uses: dropout, ALiBi,
softcapping, local (sliding-window) attention and head dims that are not a multiple of 32. Each of those halves
the template instantiations of every kernel file; ``flash_api.cpp`` refuses such a call with a message (its
``TORCH_CHECK`` under the same macros), so the macros go to the C++ compiler as well as to nvcc.

The trims remove what no build reads (composable_kernel for AMD, the Hopper FA3 sources, tests, CUTLASS's tests,
examples and tools) so that both sources travel to a GPU host without a network in a few MiB. The CUTLASS headers
kept are exactly those the compiler opened for the kept files (``nvcc -M`` for the device pass and the host pass,
with the build's flags; ``build_kernels.sh fetch`` makes that list), checked by compiling the trimmed copy.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

KEPT_KERNELS = tuple(
    f"csrc/flash_attn/src/flash_{kind}_hdim128_bf16{causal}_sm80.cu"
    for kind in ("fwd", "bwd", "fwd_split")
    for causal in ("", "_causal")
)
DISABLED = ("DROPOUT", "ALIBI", "SOFTCAP", "LOCAL", "UNEVEN_K")

FP16_SWITCH = """#define FP16_SWITCH(COND, ...)               \\
  [&] {                                      \\
    if (COND) {                              \\
      throw std::runtime_error("this flash-attn build has bf16 kernels only (lightning_d9d's build_kernels.sh)"); \\
    }                                        \\
    using elem_type = cutlass::bfloat16_t;   \\
    return __VA_ARGS__();                    \\
  }()
"""
HEADDIM_SWITCH = """#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    if (HEADDIM != 128) {                  \\
      throw std::runtime_error("this flash-attn build has head dim 128 only (lightning_d9d's build_kernels.sh)"); \\
    }                                      \\
    constexpr static int kHeadDim = 128;   \\
    return __VA_ARGS__();                  \\
  }()
"""


def _replace_macro(text: str, name: str, new: str) -> str:
    """Swap the multi-line ``#define name(...)`` (its lines end in a backslash) for ``new``."""
    pattern = re.compile(rf"#define {name}\(.*?\n(?:.*\\\n)*.*\n")
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"static_switch.h: expected one #define {name}, the source has changed")
    return pattern.sub(lambda _: new, text)


def patch_flash_attn(root: Path) -> None:
    setup = root / "setup.py"
    text = setup.read_text()
    listed = re.findall(r'"(csrc/flash_attn/src/flash_[a-z_0-9]+\.cu)",\n', text)
    missing = [kernel for kernel in KEPT_KERNELS if kernel not in listed]
    if len(listed) < len(KEPT_KERNELS) or missing:
        raise SystemExit(f"setup.py: kernel list not as expected (missing {missing}); the source has changed")
    text = re.sub(
        r' *"(csrc/flash_attn/src/flash_[a-z_0-9]+\.cu)",\n',
        lambda m: m.group(0) if m.group(1) in KEPT_KERNELS else "",
        text,
    )
    defines = [f"-DFLASHATTENTION_DISABLE_{name}" for name in DISABLED]
    anchor = '"--use_fast_math",\n'
    if text.count(anchor) != 1 or text.count('compiler_c17_flag=["-O3", "-std=c++17"]') != 1:
        raise SystemExit("setup.py: nvcc or c++ flags not where expected; the source has changed")
    text = text.replace(anchor, anchor + "".join(f'    "{d}",\n' for d in defines))
    text = text.replace(
        'compiler_c17_flag=["-O3", "-std=c++17"]',
        f'compiler_c17_flag=["-O3", "-std=c++17", {", ".join(map(repr, defines))}]',
    )
    setup.write_text(text)

    switch = root / "csrc/flash_attn/src/static_switch.h"
    text = switch.read_text()
    text = _replace_macro(text, "FP16_SWITCH", FP16_SWITCH)
    text = _replace_macro(text, "HEADDIM_SWITCH", HEADDIM_SWITCH)
    text = text.replace("#pragma once\n", "#pragma once\n\n#include <stdexcept>\n", 1)
    switch.write_text(text)
    # What is not listed is not compiled; removing it makes a stale list fail loudly instead.
    for kernel in (root / "csrc/flash_attn/src").glob("flash_*_sm80.cu"):
        if str(kernel.relative_to(root)) not in KEPT_KERNELS:
            kernel.unlink()


def _keep_only(root: Path, keep: list[str]) -> None:
    """Delete every file and folder under ``root`` whose relative path is not under one of ``keep``."""
    kept = [Path(k) for k in keep]
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        rel = path.relative_to(root)
        if any(rel == k or k in rel.parents for k in kept):
            continue
        if any(rel in k.parents for k in kept):  # a folder on the way to something kept
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _headers(deps: Path, prefix: str) -> list[str]:
    """The headers (relative to the package root) under ``prefix`` that ``nvcc -M`` listed in ``deps``."""
    headers = {
        token[token.index(prefix) :]
        for token in deps.read_text().replace("\\\n", " ").split()
        if prefix in token
    }
    if not headers:
        raise SystemExit(f"{deps}: no header under {prefix}")
    return sorted(headers)


def trim_flash_attn(root: Path, deps: Path) -> None:
    keep = [
        "setup.py",
        "setup.cfg",
        "README.md",
        "LICENSE",
        "AUTHORS",
        "MANIFEST.in",
        "PKG-INFO",
        "flash_attn",
        "csrc/flash_attn/flash_api.cpp",
        "csrc/flash_attn/src",
        "csrc/cutlass/LICENSE.txt",
        *_headers(deps, "csrc/cutlass/include/"),
    ]
    _keep_only(root, keep)
    for kernel in (root / "csrc/flash_attn/src").glob("flash_*_sm80.cu"):
        if str(kernel.relative_to(root)) not in KEPT_KERNELS:
            kernel.unlink()


def trim_grouped_gemm(root: Path, deps: Path) -> None:
    keep = [
        "setup.py",
        "setup.cfg",
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "MANIFEST.in",
        "PKG-INFO",
        "grouped_gemm",
        "csrc",
        *_headers(deps, "third_party/cutlass/include/"),
    ]
    _keep_only(root, keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("patch-flash-attn", "trim-flash-attn", "trim-grouped-gemm"))
    parser.add_argument("root", type=Path, help="the unpacked source distribution")
    parser.add_argument("--deps", type=Path, help="trim: the nvcc -M output of the kept sources")
    args = parser.parse_args()
    if args.action == "patch-flash-attn":
        patch_flash_attn(args.root)
    elif args.deps is None:
        sys.exit("trim needs --deps (nvcc -M of the kept sources)")
    elif args.action == "trim-flash-attn":
        trim_flash_attn(args.root, args.deps)
    else:
        trim_grouped_gemm(args.root, args.deps)


if __name__ == "__main__":
    main()
