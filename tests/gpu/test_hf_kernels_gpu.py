"""transformers' Qwen3 and Llama on one CUDA GPU with our kernels swapped in (``models/hf/kernels.py``): the
RMSNorms run our Triton rms_norm and the SwiGLU MLPs our Triton swiglu (each seen called), and the logits and
gradients match the unswapped model's within bf16 rounding (the kernels compute in fp32 and round once, torch's
eager ops round after each op). Run on a CUDA GPU: ``pytest -m gpu``."""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from test_hf_kernels import FAMILIES, tiny_model
from torch import nn

from lightning_d9d.models.hf.kernels import ENV_VAR, swap_hf_kernels

# the modules (the package's names rms_norm / swiglu are the functions)
rmsnorm = importlib.import_module("lightning_d9d.kernels.rmsnorm")
swiglu = importlib.import_module("lightning_d9d.kernels.swiglu")

pytestmark = pytest.mark.gpu

# Relative errors (Frobenius) against the unswapped model. Measured on an H200 (torch 2.11): gradients
# at most 1.6e-2 (Qwen3's q_proj; Llama's 1.25e-2), logits under 1e-2; a wrong gate (the activation on up)
# would be ~100 % off.
LOGITS_RTOL, GRADS_RTOL = 0.01, 0.04


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, calls: list[str]) -> None:
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def logits_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """As ``test_hf_kernels.logits_and_grads``, on the GPU."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.float().pow(2).mean() + logits[..., 3].float().sum()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_kernels_on_cuda_match_transformers(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference = tiny_model(family).to("cuda", torch.bfloat16)
    model = copy.deepcopy(reference)
    swap_hf_kernels(model)
    calls: list[str] = []
    _counting(monkeypatch, rmsnorm, "rms_norm_triton", calls)
    _counting(monkeypatch, swiglu, "swiglu_triton", calls)
    logits, grads = logits_and_grads(model)
    assert {"rms_norm_triton", "swiglu_triton"} <= set(calls)
    calls.clear()
    expected_logits, expected_grads = logits_and_grads(reference)
    assert not calls  # transformers' own forwards
    errors = {"logits": _relative(logits, expected_logits)}
    errors.update({name: _relative(grad, expected_grads[name]) for name, grad in grads.items()})
    print(
        f"{family}: relative errors, largest {max(errors.values()):.2e}",
        sorted(errors.items(), key=lambda e: -e[1])[:4],
    )
    assert errors["logits"] <= LOGITS_RTOL
    assert all(error <= GRADS_RTOL for name, error in errors.items() if name != "logits"), errors


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` (Frobenius norms, in fp32)."""
    return float((got.float() - expected.float()).norm() / expected.float().norm())
