"""Head-parallel context parallelism (``context_attention="heads"``) on CUDA: 2 gloo ranks sharing ``cuda:0``
(``run_distributed(..., share_cuda=True)``; NCCL refuses two ranks on one device) train against one process on the
same GPU, fp32 with TF32 off, 3 AdamW steps, every case in one launch:

- our Qwen3, causal (the attention registry's CUDA choice for fp32), and compiled per block (the exchanges are
  torch's functional all-to-alls, which ``torch.compile`` traces);
- our Qwen3 on packed rows of two whole 128-token blocks: on CUDA the model's own mask is FlexAttention's block
  mask of the whole rows, which each rank runs for its heads;
- ``transformers``' Qwen3 through the adapter (its SDPA) with a padding mask.

The band is 1e-4 (the CPU tests' 1e-5 with room for CUDA kernels that tile ``heads / cp`` heads otherwise than
``heads``: the same sums in another order). A wrong exchange or mask is ~1e-2 off (tests/modules and
tests/models/hf show it on CPU).

Run on a CUDA GPU: ``PYTHONPATH=$PWD pytest -m gpu tests/gpu/test_head_parallel_gpu.py`` (the spawned ranks
import the package).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modules"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from test_head_parallel_attention import build, full
from test_hf_context_parallel import cp_model, padded_batch

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, split_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BAND, STEPS = 1e-4, 3
# name -> (model, row length, packed rows' documents or None, compile)
CASES: dict[str, tuple[str, int, list[tuple[int, ...]] | None, bool]] = {
    "qwen3": ("qwen3", 64, None, False),
    "qwen3_compiled": ("qwen3", 64, None, True),
    "qwen3_packed_flex": ("qwen3", 256, [(100, 156), (30, 130, 96)], False),
    "hf_qwen3_padded": ("hf_qwen3", 16, None, False),
}


def model_for(kind: str) -> nn.Module:
    return cp_model("qwen3") if kind == "hf_qwen3" else build(kind, {})


def batch(kind: str, step: int, length: int, documents: list[tuple[int, ...]] | None) -> dict[str, Any]:
    """The step's inputs (by keyword) and shifted labels, on CUDA."""
    if kind == "hf_qwen3":
        ids, mask, labels = padded_batch(step)
        return {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": labels.cuda()}
    generator = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, 256, (2, length), generator=generator)
    labels = torch.randint(0, 256, (2, length), generator=generator)
    labels[0, -5:] = -100
    inputs = {"input_ids": ids.cuda(), "labels": labels.cuda()}
    if documents is not None:
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
        inputs["position_ids"] = positions.cuda()
    return inputs


def train(
    model: nn.Module, kind: str, length: int, documents: Any, split: LoadBalancedSplit | None = None
) -> list[float]:
    """AdamW on fixed batches; under cp each rank weighs its loss by its share of the counted tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)
    losses = []
    for step in range(STEPS):
        inputs = batch(kind, step, length, documents)
        labels = inputs.pop("labels")
        if split is not None:
            inputs, labels = split_batch(split, inputs, labels)  # type: ignore[assignment]
        output = model(**inputs)
        loss = causal_lm_loss(getattr(output, "logits", output), labels)
        if split is not None:
            count = causal_lm_loss.count(labels).to(torch.int64)
            total = count.clone()
            dist.all_reduce(total)
            loss = loss * (count * split.cp / total)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if split is not None:
            dist.all_reduce(value)
            value /= split.cp
        losses.append(float(value))
    return losses


def _runs(names: list[str], world: int) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dims = None if world == 1 else ParallelDims(cp=2).resolve(world).build_mesh("cuda")
    results: dict[str, Any] = {}
    for name in names:
        kind, length, documents, compiled = CASES[name]
        model = model_for(kind).cuda()
        split = None
        if dims is not None:
            options = ParallelOptions(context_attention="heads", compile=compiled)
            if kind == "hf_qwen3":
                parallelize_hf(model, dims, options)
            else:
                model.parallelize(dims, options)  # type: ignore[operator]
            split = LoadBalancedSplit(2, dims.mesh_for("cp").get_local_rank())
        losses = train(model, kind, length, documents, split)
        params = {
            n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): full(p).detach().cpu()
            for n, p in model.named_parameters()
        }
        results[name] = {"losses": losses, "params": params}
    return results


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], dict[str, Any]]:
    names = list(CASES)
    got = run_distributed(_runs, 2, names, 2, share_cuda=True, timeout=900)[0]
    expected = run_distributed(_runs, 1, names, 1, share_cuda=True, timeout=900)[0]
    return got, expected


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_heads_on_one_gpu_trains_like_one_process(
    case: str, runs: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    got, expected = runs[0][case], runs[1][case]
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= BAND
    assert set(got["params"]) == set(expected["params"])
    for name, param in expected["params"].items():
        assert float((got["params"][name] - param).abs().max()) <= BAND, name
