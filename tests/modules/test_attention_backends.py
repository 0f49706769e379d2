"""The attention backend registry: every backend that runs on CPU equals plain softmax attention, ``auto``
picks per device and dtype and logs once, a forced backend is used or refused with the reason, and a registered
backend joins ``auto``'s order."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_gqa_attention import reference_attention

from lightning_d9d.modules import Attention, RotaryEmbedding
from lightning_d9d.modules import attention as attention_module
from lightning_d9d.modules.attention import (
    AttentionBackend,
    attention_backends,
    register_attention_backend,
    select_attention_backend,
)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(attention_module._REGISTRY, "backends", dict(attention_module._REGISTRY.backends))
    monkeypatch.setattr(attention_module._REGISTRY, "announced", set())
    monkeypatch.delenv("LIGHTNING_D9D_ATTENTION", raising=False)
    yield


def _block_and_inputs() -> tuple[Attention, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    block = Attention(32, 4, 2, 8)
    rope = RotaryEmbedding(8, 16, 10000.0)
    x = torch.randn(2, 7, 32)
    cos, sin = rope(None, 7, x.dtype)
    return block, x, cos, sin


@pytest.mark.parametrize("name", ["sdpa", "sdpa_math"])
def test_cpu_backends_equal_softmax_attention(name: str) -> None:
    block, x, cos, sin = _block_and_inputs()
    block.attention_backend = name
    torch.testing.assert_close(
        block(x, cos, sin), reference_attention(block, x, cos, sin), rtol=1e-5, atol=1e-5
    )


def test_auto_on_cpu_is_plain_sdpa_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    q = torch.randn(1, 4, 3, 8)
    with caplog.at_level(logging.INFO, logger="lightning_d9d.modules"):
        assert select_attention_backend(q).name == "sdpa"
        assert select_attention_backend(q.bfloat16()).name == "sdpa"
    assert caplog.text.count("attention backend: sdpa") == 1


def test_forced_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 4, 3, 8)
    monkeypatch.setenv("LIGHTNING_D9D_ATTENTION", "sdpa_math")
    assert select_attention_backend(q).name == "sdpa_math"
    assert select_attention_backend(q, "sdpa").name == "sdpa"  # the module's own choice wins
    with pytest.raises(
        ValueError, match=r"'sdpa_cudnn' cannot run torch.float32 queries on cpu: it runs on CUDA"
    ):
        select_attention_backend(q, "sdpa_cudnn")
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'.*sdpa_flash"):
        select_attention_backend(q, "fast")


def test_a_registered_backend_joins_auto() -> None:
    calls: list[int] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape[2])
        return attention_module._sdpa_with(None)(q, k, v)

    register_attention_backend(
        AttentionBackend("mine", run, lambda q: None, lambda q: q.device.type == "cpu"), before="sdpa_cudnn"
    )
    names = attention_backends()
    assert names.index("mine") == names.index("sdpa_cudnn") - 1
    block, x, cos, sin = _block_and_inputs()
    torch.testing.assert_close(
        block(x, cos, sin), reference_attention(block, x, cos, sin), rtol=1e-5, atol=1e-5
    )
    assert calls == [7]
    with pytest.raises(ValueError, match="'auto' is reserved"):
        register_attention_backend(AttentionBackend("auto", run, lambda q: None, lambda q: True))


@pytest.mark.parametrize("name", [None, "sdpa_math"])
def test_compiles_as_one_graph(name: str | None) -> None:
    """The blocks are compiled with fullgraph=True: selecting (and forcing) a backend must trace."""
    block, x, cos, sin = _block_and_inputs()
    block.attention_backend = name
    expected = block(x, cos, sin)
    attention_module._REGISTRY.announced.clear()  # the first call under compile is the one that selects
    block.compile(fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(block(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def _cuda_queries(head_dim: int) -> Any:
    """What the backends' checks read of bf16 CUDA queries (no GPU here)."""
    return SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0", shape=(2, 16, 64, head_dim))


@pytest.mark.parametrize(
    ("capability", "head_dim", "expected"),
    [
        ((9, 0), 128, "sdpa_cudnn"),
        ((9, 0), 64, "sdpa_cudnn"),
        ((9, 0), 256, "sdpa_flash"),  # cuDNN takes it on 9.0, but was measured at 128 only
        ((8, 0), 128, "sdpa_flash"),
        ((9, 0), 100, "sdpa"),  # no kernel of torch's named ones takes it: torch chooses
        ((9, 0), 264, "sdpa"),
    ],
)
def test_auto_takes_a_kernel_only_for_head_dims_it_takes(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], head_dim: int, expected: str
) -> None:
    """A model whose head dim cuDNN refuses (a transformers model's 256, say) must not be sent to it by ``auto``:
    SDPA with a forced kernel raises where plain SDPA would have picked another. FA4 and flash-attn 2 are absent
    here; the CUDA checks are stood in for."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention_module.fa4, "INSTALLED", False)
    monkeypatch.setattr(attention_module, "_FLASH_ATTN_INSTALLED", False)
    assert select_attention_backend(_cuda_queries(head_dim)).name == expected


@pytest.mark.parametrize(
    ("name", "capability", "head_dim", "refusal"),
    [
        ("sdpa_cudnn", (9, 0), 256, None),
        ("sdpa_cudnn", (8, 0), 256, "up to 128, got 256"),
        ("sdpa_cudnn", (9, 0), 72, None),
        ("sdpa_cudnn", (9, 0), 100, "up to 256, got 100"),
        ("sdpa_flash", (8, 0), 256, None),
        ("sdpa_flash", (9, 0), 264, "up to 256, got 264"),
    ],
)
def test_a_named_kernel_refuses_the_head_dims_torch_would(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    capability: tuple[int, int],
    head_dim: int,
    refusal: str | None,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if refusal is None:
        assert select_attention_backend(_cuda_queries(head_dim), name).name == name
    else:
        with pytest.raises(
            ValueError, match=rf"'{name}' cannot run .*: it takes head dims in multiples of 8 .*{refusal}"
        ):
            select_attention_backend(_cuda_queries(head_dim), name)
