"""Several ranks on one GPU: every layout of ``layout_runs.SHARED_GPU_LAYOUTS`` run by 2 (or 4) gloo ranks that
all compute on ``cuda:0`` (``run_distributed(..., share_cuda=True)``; NCCL refuses two ranks on one device),
against the one-rank run of the same model on the same GPU. The ranks' CUDA code is the multi-GPU code: DTensor's
CUDA kernels under tp (sequence and loss parallel, the fused LM-head loss), FSDP2's streams and all-gathers,
torch's CUDA ring attention and our all-gather attention under cp, the MoE all-to-all and the Triton permutation
with CUDA tensors under ep, the pipeline stages passing CUDA activations (1F1B and the zero-bubble V schedule),
float8 all-gathers at dp_shard=2; for transformers' Qwen3 / Qwen3-MoE through the adapter and for our own models.
Only the transport differs (gloo copies through host memory): this proves the layouts exact on CUDA, not fast.

Two precisions, each layout's runs in one launch per world size (a launch costs seconds of imports and CUDA
set-up per rank, a tiny run less):
- fp32 with TF32 off, at the CPU tests' tiny shape (``test_hf_layout_runs.CPU``): the same band as the CPU dry
  run (``FP32_BAND``), since fp32 kernels summing in another order differ by ~1e-7 relative on either device;
- bf16 (``bf16-mixed`` as the strategy runs it) at the two-GPU tests' shape (``layout_runs.TWO_GPU``), in their
  bands (``test_two_gpu_layouts_gpu.band_for``, derived in that module's docstring: same arithmetic, same bands).

Run on a CUDA GPU: ``PYTHONPATH=$PWD pytest -m gpu tests/gpu/test_shared_gpu_layouts_gpu.py`` (the spawned ranks
import the package).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from layout_runs import (
    SHARED_GPU_LAYOUTS,
    TWO_GPU,
    Layout,
    Shape,
    assert_applied,
    differences,
    start_parameters,
    train_layouts,
)
from test_hf_layout_runs import CPU, FP32_BAND
from test_two_gpu_layouts_gpu import band_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PRECISIONS = ("fp32", "bf16")


def shape_for(layout: Layout, precision: str) -> Shape:
    """The CPU tests' tiny shape in fp32 (4 layers under the V schedule: two stages a rank), the two-GPU tests'
    shape in bf16."""
    if precision == "bf16":
        return TWO_GPU
    return Shape(layers=4) if layout.schedule == "ZBVZeroBubble" else CPU


def runnable(layout: Layout) -> str | None:
    """Why this machine cannot run ``layout``, or None."""
    if layout.fp8 is not None:
        if importlib.util.find_spec("torchao") is None:
            return "FP8 needs torchao (without a network: the carried wheel, benchmarks/README.md)"
        if torch.cuda.get_device_capability(0) < (8, 9):
            return "float8 matmuls need compute capability 8.9 (Ada) or newer"
    return None


@functools.cache
def shared_gpu_runs(precision: str) -> dict[str, Any]:
    """Every runnable layout's result by name, and the one-rank runs' by ``"reference:<name>"``."""
    layouts = {name: layout for name, layout in SHARED_GPU_LAYOUTS.items() if runnable(layout) is None}
    results: dict[str, Any] = {}
    for world in sorted({layout.world for layout in layouts.values()}):
        runs = [(name, lay, shape_for(lay, precision)) for name, lay in layouts.items() if lay.world == world]
        results |= run_distributed(train_layouts, world, runs, precision, share_cuda=True, timeout=900)[0]
    references = [
        (f"reference:{name}", layout.one_rank(), shape_for(layout, precision))
        for name, layout in layouts.items()
    ]
    results |= run_distributed(train_layouts, 1, references, precision, share_cuda=True, timeout=900)[0]
    return results


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(SHARED_GPU_LAYOUTS))
def test_ranks_sharing_one_gpu_train_as_one_rank(name: str, precision: str) -> None:
    layout = SHARED_GPU_LAYOUTS[name]
    reason = runnable(layout)
    if reason is not None:
        pytest.skip(reason)
    results = shared_gpu_runs(precision)
    got, expected = results[name], results[f"reference:{name}"]
    assert not isinstance(expected, str), expected  # a traceback
    assert not isinstance(got, str), got
    shape = shape_for(layout, precision)
    assert_applied(layout, got["facts"], expected["facts"])
    errors = differences(got, expected, start_parameters(layout, shape))
    print(f"{name} {precision}: {', '.join(f'{key} {value:.3g}' for key, value in errors.items())}")
    assert errors["steps"] == shape.steps
    assert errors["moved"] > 0.1  # the steps moved the parameters
    bands = FP32_BAND if precision == "fp32" else band_for(layout)
    for key, band in bands.items():
        assert errors[key] <= band, (name, precision, key, errors)
