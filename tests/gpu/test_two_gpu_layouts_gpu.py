"""Two-GPU layouts over NCCL: transformers' Qwen3 and Qwen3-MoE under the strategy's plans, trained in bf16
against the one-GPU run of the same model. Needs 2 GPUs; FP8 needs torchao (on a host without a network the
carried wheel: ``benchmarks/README.md``'s FP8 section, ``benchmarks/h200x2_runs.sh gpu`` installs it) and compute
capability 8.9+; DeepEP needs ``deep_ep`` (``h200x2_runs.sh deepep`` builds it).

Each test spawns two NCCL ranks (``tests/distributed.py``, NVLink multicast off) that run
``tests/models/hf/layout_runs.train_layout``: the adapter's plans (``parallelize_hf``; under pp the stages carved
and the 1F1B schedule, as ``D9DStrategy`` does), ``model_loss``'s token weighting, 8 AdamW steps on tiny_hf's
seeded batches, in the strategy's ``bf16-mixed`` (bf16 parameters for compute, fp32 gradient reduction, fp32
master weights), at ``layout_runs.TWO_GPU``'s shape (4 layers of hidden 512, vocabulary 4096, 4 x 128 tokens per
step). The reference is the same worker on one GPU (one rank: FSDP on one rank, no other plan). Layouts: Qwen3 at
tp=2 (sequence and loss parallel, the adapter's tp plan), cp=2 with torch's ring kernels and with our all-gather
path, pp=2 (1F1B, 2 microbatches); Qwen3-MoE at ep=2 (with dp_shard=2: the experts split, each rank its rows)
through the all-to-all dispatcher and through DeepEP, and at tp=2 with each expert split over tp
(``expert_tensor_parallel``); Qwen3 at dp_shard=2 with FP8 tensorwise (float8 FSDP all-gathers) and rowwise, each
against the one-GPU run with the same recipe, which takes each data rank's rows as a micro-step of its own (float8
scales an activation over the rows its matmul sees). The same worker and checks run on CPU in fp32 in
``tests/models/hf/test_hf_layout_runs.py`` (the dry run: 1e-5 bands hold there).

Compared per step (``layout_runs.differences``): the loss of the global batch and the gradient norm before the
step, relative to the reference's, and at the end how the parameters moved, ``||dW - dW_ref|| / ||dW_ref||`` over
all of them (dW: the change from the common start). The bands, from bf16's rounding: bf16 keeps 8 significant
bits (2^-9 relative per rounding); the runs compute the same sums split differently (shards, ring steps, stages,
reductions), so their activations differ by a few such roundings and the first step's loss, a mean over 504
token losses, by far less (the per-token errors average out). The trajectories then drift: AdamW steps each
weight by about lr whatever its gradient's size, so where a gradient is near zero its rounding decides the sign
of the step (eps=1e-4 damps this). In Qwen3-MoE a rounding difference also turns a token's top-2 choice where two
router scores are within bf16's rounding of each other, sending it through other experts; in FP8 a rounding
difference moves a value across a float8 e4m3 rounding boundary (2^-4 relative), and at tensorwise one GPU casts
its weights to float8 from their bf16 copy, dp_shard=2's float8 all-gather from the fp32 shards.

Measured with the same worker and shape on two gloo ranks in bf16 (CPU, torch 2.13; CPU and GPU
both accumulate bf16 products in fp32): loss / gradient norm / parameter movement at most 5.2e-4 / 3.7e-4 / 3.5e-2
for the dense layouts (tp, cp all-gather, pp), 3.3e-3 / 1.9e-2 / 0.25 for ep=2, 6.6e-3 / 3.9e-2 / 0.37 for tp=2 with
the experts split over tp, 4.0e-3 / 5.2e-3 / 0.33 for FP8 tensorwise (rowwise: the same bits as its one-rank run).
The bands below are 4-30x the dense numbers and 1.9-6x the MoE and FP8 ones. What they must catch, measured
alike: a run on other batches (the reference's data shifted) moves its parameters 1.41 apart (uncorrelated steps:
sqrt(2)) while its losses stay within 1.6e-2 (tiny_hf's labels are random: any model's loss on them is near the
same number); cp=2 attending without the causal mask is 3.9e-3 off in the first loss, 2.3e-2 in the gradient norm
and 1.27 in the movement. So the dense loss band is tight enough to see a wrong attention by itself, while for MoE
and FP8 the gradient norm and the movement are what tell a wrong gradient.
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
from layout_runs import LAYOUTS, TWO_GPU, Layout, assert_applied, differences, start_parameters, train_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 kind)"),
]

DENSE_BAND = {"loss": 2e-3, "norm": 1e-2, "update": 0.2}
MOE_BAND = {"loss": 2e-2, "norm": 0.1, "update": 0.7}
FP8_BAND = {"loss": 2e-2, "norm": 5e-2, "update": 0.7}


@functools.cache
def one_gpu_run(family: str, fp8: str | None, micro_steps: int) -> dict[str, Any]:
    layout = Layout(family, fp8=fp8, micro_steps=micro_steps)
    (result,) = run_distributed(train_layout, 1, layout, TWO_GPU, "bf16", backend="nccl", timeout=600)
    return result


def needs(layout: Layout) -> None:
    """Skip, naming the reason, where this machine cannot run ``layout``."""
    if layout.fp8 is not None:
        if importlib.util.find_spec("torchao") is None:
            pytest.skip("FP8 needs torchao (without a network: the carried wheel, benchmarks/README.md)")
        if torch.cuda.get_device_capability(0) < (8, 9):
            pytest.skip("float8 matmuls need compute capability 8.9 (Ada) or newer")
    if layout.dispatch == "deepep" and importlib.util.find_spec("deep_ep") is None:
        pytest.skip("needs deep_ep built on this machine (benchmarks/h200x2_runs.sh deepep)")


def band_for(layout: Layout) -> dict[str, float]:
    if layout.fp8 is not None:
        return FP8_BAND
    return MOE_BAND if layout.family.endswith("qwen3_moe") else DENSE_BAND


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_gpus_train_as_one_gpu_in_bf16(name: str) -> None:
    layout = LAYOUTS[name]
    needs(layout)
    got = run_distributed(train_layout, layout.world, layout, TWO_GPU, "bf16", backend="nccl", timeout=600)[0]
    reference = layout.one_rank()
    expected = one_gpu_run(reference.family, reference.fp8, reference.micro_steps)
    assert_applied(layout, got["facts"], expected["facts"])
    errors = differences(got, expected, start_parameters(layout, TWO_GPU))
    print(
        f"{name}: {', '.join(f'{key} {value:.3g}' for key, value in errors.items())}\n"
        f"  losses {[round(x, 4) for x in got['losses']]}\n  one GPU {[round(x, 4) for x in expected['losses']]}"
    )
    assert errors["steps"] == TWO_GPU.steps
    assert errors["moved"] > 1.0  # the steps moved the parameters (~11 on CPU)
    for key, band in band_for(layout).items():
        assert errors[key] <= band, (name, key, errors)
