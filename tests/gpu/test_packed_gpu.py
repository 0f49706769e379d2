"""Packed rows on CUDA: the document-masked attention (SDPA with the block-diagonal causal mask, whichever kernel
torch takes for a mask there) against the CPU-exact path, fp32 and bf16; on two GPUs a Fabric loop at cp=2
(``context_attention="auto"``: torch's ring kernels, packed batches on the all-gather path over NCCL) against
one GPU's plain loop, fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fabric"))
from fabric_loop import BASE, reference_run
from test_packed_documents import build, documents, packed_batch

from lightning_d9d.modules.loss import causal_lm_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_packed_rows_on_cuda_match_the_cpu_path(kind: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind)
    batch = packed_batch(documents(model.config.vocab_size))
    inputs = (batch["input_ids"], batch["position_ids"])
    cpu_loss = causal_lm_loss(model(*inputs), batch["labels"])
    cpu_loss.backward()
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.cuda()
    cuda_inputs = tuple(t.cuda() for t in inputs)
    labels = batch["labels"].cuda()
    loss = causal_lm_loss(model(*cuda_inputs), labels)
    loss.backward()
    # fp32 on two devices: reductions in another order only
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-5, atol=1e-5)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad.cpu(), grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = causal_lm_loss(model(*cuda_inputs), labels)
    # measured on the H200 (2026-12-03): 3.2e-5 (Qwen3) and 2.1e-5 (Qwen3-MoE) relative to the fp32 CPU loss; a
    # bf16 loss over ~60 tokens averages its per-token rounding (2^-8 each): the band is 30x the measurement
    reference = float(cpu_loss.detach())
    relative = abs(float(bf16) - reference) / reference
    print(f"packed {kind}: bf16 loss {float(bf16):.5f} vs fp32 {reference:.5f} ({relative:.1e} relative)")
    assert relative < 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_packed_rows_at_cp2_on_two_gpus_match_one_gpu(tmp_path: Path) -> None:
    config = {
        **BASE,
        "devices": 2,
        "accelerator": "cuda",
        "dims": {"cp": 2},  # context_attention="auto": torch's ring kernels, which hand packed rows on
        "packed": True,
        "out": str(tmp_path / "run.pt"),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NVIDIA_TF32_OVERRIDE": "0"}
    script = Path(__file__).resolve().parents[1] / "fabric" / "fabric_loop.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--fork", json.dumps([config])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    actual = torch.load(tmp_path / "run.pt", weights_only=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    expected = reference_run(config, dp=1, device="cuda")
    loss_diff = max(abs(a - e) / e for a, e in zip(actual["losses"], expected["losses"], strict=True))
    param_diff = max(float((actual["params"][n] - v).abs().max()) for n, v in expected["params"].items())
    print(f"cp2 packed on 2 GPUs: relative loss difference {loss_diff:.2e}, parameters {param_diff:.2e}")
    # fp32, the same bands as the one-GPU Fabric test (tests/gpu/test_fabric_gpu.py)
    torch.testing.assert_close(
        torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0
    )
    for name, value in expected["params"].items():
        torch.testing.assert_close(actual["params"][name], value, rtol=0, atol=2e-5, msg=name)
