"""transformers' Qwen3 on one CUDA GPU, bf16, a plain causal forward under the adapter's switch
(``models/hf/attention.py``): our attention backends run it (``auto``'s choice for these queries, the one our own
models take: cuDNN's SDPA on Hopper, FlashAttention 4 where ``auto`` prefers it), never transformers' SDPA
function, and the logits and gradients match the untouched ``sdpa`` model's within bf16 rounding (another kernel:
not bit for bit), eager and with its decoder layers compiled whole (``fullgraph=True``, as the compile plan
compiles a dense layer). Run on a CUDA GPU: ``pytest -m gpu``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from tiny_hf import tiny_causal_lm
from torch import nn
from transformers.modeling_utils import AttentionInterface

import lightning_d9d.models.hf.attention as hf_attention
from lightning_d9d.models.hf.attention import SDPA, causal_attention_without_mask_sync
from lightning_d9d.modules.attention import ENV_VAR, AttentionBackend, select_attention_backend

pytestmark = pytest.mark.gpu

# Relative errors (Frobenius) against the untouched model, as test_hf_kernels_gpu.py allows for bf16 kernels that
# round differently; a wrong layout or a missing causal mask is ~100 % off.
LOGITS_RTOL, GRADS_RTOL = 0.01, 0.04


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def logits_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    ids = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.float().pow(2).mean() + logits[..., 3].float().sum()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("compiled", "head_dim"), [(False, 128), (True, 128), (False, 256)])
def test_a_transformers_model_takes_our_attention_backend_on_cuda(
    compiled: bool, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head dim 256 (Gemma's): ``auto`` must not force cuDNN, measured at 128 only (torch's flash kernel, or FA4)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference = tiny_causal_lm("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    reference = reference.to("cuda", torch.bfloat16)
    model = copy.deepcopy(reference)
    sdpa_calls: list[nn.Module] = []
    original = AttentionInterface._global_mapping[SDPA]

    def recorded(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        sdpa_calls.append(module)
        return original(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, SDPA, recorded)
    chosen: list[str] = []

    def selected(q: torch.Tensor, name: str | None = None) -> AttentionBackend:
        backend = select_attention_backend(q, name)
        chosen.append(backend.name)
        return backend

    monkeypatch.setattr(hf_attention, "select_attention_backend", selected)
    expected_logits, expected_grads = logits_and_grads(reference)
    sdpa_calls.clear()
    assert causal_attention_without_mask_sync(model)
    if compiled:
        torch.compiler.reset()
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    try:
        logits, grads = logits_and_grads(model)
    finally:
        if compiled:
            torch.compiler.reset()
    assert sdpa_calls == []
    queries = torch.empty(1, 4, 256, head_dim, device="cuda", dtype=torch.bfloat16)
    auto = select_attention_backend(queries).name
    assert chosen and set(chosen) == {auto}  # at trace time only, when compiled
    if torch.cuda.get_device_capability()[0] == 9:
        assert auto in (("sdpa_cudnn" if head_dim <= 128 else "sdpa_flash"), "flash_attn4")
    assert relative(logits, expected_logits) < LOGITS_RTOL
    for name, grad in expected_grads.items():
        assert relative(grads[name], grad) < GRADS_RTOL, name
