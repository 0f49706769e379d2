"""The CPU dry run of the two-GPU layout tests (``tests/gpu/test_two_gpu_layouts_gpu.py``): the same worker
(``layout_runs.train_layout``), the same checks that each layout was applied and the same comparison with the
one-rank run, on two gloo ranks in fp32 with tiny_hf's tiny models, in a band of fp32 rounding. It proves the
worker's logic (the batches each rank takes, the token weights, the reference, the comparison of every step)
before a GPU runs it.

Layouts run here: tp=2, cp=2 all_gather, pp=2 1F1B, ep=2 all-to-all and FP8 tensorwise / rowwise at dp_shard=2
(the first CPU test of FP8 on a transformers model). Not here: cp=2 torch_ring (torch's ring kernels are
CUDA-only) and ep=2 DeepEP (``deep_ep`` runs on GPUs only). Each layout against the unmodified model is the CPU
parity tests' work (``test_hf_tensor_parallel.py``, ``test_hf_context_parallel.py``, ``test_hf_pipeline.py``,
``test_hf_expert_parallel.py``); the one-rank run the worker compares with is held to their reference loop here
(``tiny_hf.reference_run``).

The band (``FP32_BAND``): the same fp32 arithmetic summed in another order (shards' partial products, gloo's
reductions, the pipeline's microbatches) differs in the last bits, ~1e-7 relative; AdamW's eps=1e-4 keeps the
updates linear in such noise (``tiny_hf.optimizer_for``). Measured over the 6 steps: at most 1.9e-7 relative in a
loss, 1.8e-7 in a gradient norm and 2.1e-6 of the parameters' movement (FP8: the same bits as the one-rank run
taking each data rank's rows as a micro-step). Bands 100x and more above that, far below what a wrong step, seed,
weighting or plan gives (1e-3 and more).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from distributed import run_distributed
from layout_runs import LAYOUTS, Layout, Shape, assert_applied, differences, start_parameters, train_layout
from tiny_hf import reference_run, tiny_causal_lm

CPU = Shape()  # tiny_hf's tiny models and batches: 2 layers, hidden 64, 4 rows of 8 tokens, 6 steps
FP32_BAND = {"loss": 1e-5, "norm": 1e-5, "update": 1e-4}
DRY_RUN = [
    "tp2",
    "cp2_all_gather",
    "pp2_1F1B",
    "ep2_all_to_all",
    "dp_shard2_fp8_tensorwise",
    "dp_shard2_fp8_rowwise",
]


@functools.cache
def one_rank_run(family: str, fp8: str | None = None, micro_steps: int = 1) -> dict[str, Any]:
    layout = Layout(family, fp8=fp8, micro_steps=micro_steps)
    (result,) = run_distributed(train_layout, 1, layout, CPU, "fp32", timeout=120)
    return result


@pytest.mark.parametrize("name", DRY_RUN)
def test_the_two_rank_layout_trains_as_the_one_rank_run_in_fp32(name: str) -> None:
    layout = LAYOUTS[name]
    if layout.fp8 is not None:
        pytest.importorskip("torchao", reason="FP8 needs torchao (pyproject's test extra)")
    got = run_distributed(train_layout, layout.world, layout, CPU, "fp32", timeout=120)[0]
    reference = layout.one_rank()
    expected = one_rank_run(reference.family, reference.fp8, reference.micro_steps)
    assert_applied(layout, got["facts"], expected["facts"])
    errors = differences(got, expected, start_parameters(layout, CPU))
    print(name, {key: f"{value:.3g}" for key, value in errors.items()})
    assert errors["steps"] == CPU.steps
    assert errors["learnt"] > 1e-2 and errors["moved"] > 1e-1  # the steps changed the loss and the parameters
    for key, band in FP32_BAND.items():
        assert errors[key] <= band, (key, errors)


def test_the_one_rank_run_is_the_parity_tests_reference() -> None:
    """The worker's one-rank run (FSDP on one rank, ``model_loss``'s pieces) trains as the CPU parity tests'
    reference loop trains the unmodified model: the same batches, loss, optimizer and steps."""
    got = one_rank_run("qwen3")
    expected = reference_run(tiny_causal_lm("qwen3", layers=CPU.layers), CPU.steps)
    errors = differences(got, expected, start_parameters(Layout("qwen3"), CPU))
    assert errors["loss"] <= 1e-6 and errors["norm"] <= 1e-6 and errors["update"] <= 1e-5, errors
