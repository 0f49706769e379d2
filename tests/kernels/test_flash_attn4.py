"""FlashAttention 4 as torch custom operators (``lightning_d9d/kernels/flash_attn4.py``) and as the ``flash_attn4``
attention backend, on CPU: FA4's interface is replaced by a stand-in with its layouts (``fa4_reference.py``), so
what is tested is ours: the transposes, grouped heads, the fake kernels' shapes, strides and dtypes against the real
outputs (``torch.library.opcheck``), the autograd wiring (each gradient to its input), one graph under
``torch.compile``, and which inputs the backend refuses and why. FA4's kernels themselves: tests/gpu."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import fa4_reference
import pytest
import torch
import torch.nn.functional as F

from lightning_d9d.kernels import flash_attn4 as fa4
from lightning_d9d.modules import Attention, RotaryEmbedding
from lightning_d9d.modules import attention as attention_module
from lightning_d9d.modules.attention import (
    AttentionBackend,
    register_attention_backend,
    select_attention_backend,
)


@pytest.fixture(autouse=True)
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    fa4_reference.install(monkeypatch)
    monkeypatch.setattr(attention_module._REGISTRY, "backends", dict(attention_module._REGISTRY.backends))
    monkeypatch.delenv("LIGHTNING_D9D_ATTENTION", raising=False)
    yield


def _qkv(
    batch: int = 2, heads: int = 4, kv_heads: int = 2, length: int = 7, dim: int = 8
) -> list[torch.Tensor]:
    """[B, H, T, D] views of [B, T, H, D] tensors, as the attention block hands them over."""
    torch.manual_seed(0)
    shapes = [(batch, length, h, dim) for h in (heads, kv_heads, kv_heads)]
    return [torch.randn(*s).transpose(1, 2).requires_grad_() for s in shapes]


def test_the_backend_equals_causal_sdpa_forward_and_backward() -> None:
    q, k, v = _qkv()
    out = attention_module._flash_attn4(q, k, v)
    assert out.shape == q.shape
    got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach())
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref) + ref.detach())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want, strict=True):  # dq, dk, dv each to its own input (k and v differ)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert fa4_reference.CALLS == ["forward", "backward"]


def test_a_given_scale_reaches_the_kernel() -> None:
    q, k, v = (x.transpose(1, 2) for x in _qkv())
    out = fa4.flash_attn4(q, k, v, scale=0.3)
    ref = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_the_operators_pass_opcheck(varlen: bool) -> None:
    """Schema, fake kernels (their shapes, strides and dtypes equal the real outputs'), autograd registration and
    AOT dispatch with dynamic shapes, for the forward and the backward; bf16 inputs, as the model runs them (the
    log-sum-exp stays fp32)."""
    q, k, v = (x.detach().transpose(1, 2).contiguous().bfloat16().requires_grad_() for x in _qkv(length=9))
    cu, longest = None, 0
    if varlen:  # the two rows end to end: documents of 4, 5 and 9 tokens
        q, k, v = (x.detach().reshape(-1, *x.shape[2:]).requires_grad_() for x in (q, k, v))
        cu, longest = torch.tensor([0, 4, 9, 18], dtype=torch.int32), 9
    scale = 1 / math.sqrt(q.shape[-1])
    torch.library.opcheck(fa4._forward, (q, k, v, cu, longest, scale))
    out, lse = fa4._forward(q, k, v, cu, longest, scale)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16
    # the backward operator is not differentiated again: its checks take plain tensors
    inputs = [x.detach() for x in (torch.randn_like(out), q, k, v, out, lse)]
    torch.library.opcheck(
        fa4._backward, (*inputs, cu, longest, scale), test_utils=("test_schema", "test_faketensor")
    )


def test_the_fake_kernels_give_contiguous_outputs_of_fa4s_layouts() -> None:
    """Under FakeTensorMode (what torch.compile traces with): out ``[B, T, H, Dv]``, the log-sum-exp fp32 ``[B, H,
    T]`` (varlen ``[H, total]``), the gradients contiguous even when the inputs are not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 16, 12, 64, dtype=torch.bfloat16).transpose(
            1, 2
        )  # [2, 12, 16, 64], not contiguous
        k = v = torch.empty(2, 12, 4, 64, dtype=torch.bfloat16)
        out, lse = fa4._forward(q, k, v, None, 0, 0.125)
        assert (out.shape, out.dtype, out.is_contiguous()) == ((2, 12, 16, 64), torch.bfloat16, True)
        assert (lse.shape, lse.dtype) == ((2, 16, 12), torch.float32)
        dq, dk, dv = fa4._backward(out, q, k, v, out, lse, None, 0, 0.125)
        assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
        assert all(t.is_contiguous() for t in (dq, dk, dv))
        out, lse = fa4._forward(q[0], k[0], v[0], torch.empty(3, dtype=torch.int32), 8, 0.125)
        assert (out.shape, lse.shape) == ((12, 16, 64), (16, 12))


def _capability_stand_in(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(fa4, "INSTALLED", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _cuda_like(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> Any:
    """What the check reads of the queries, as a CUDA tensor would answer (no GPU here)."""
    return SimpleNamespace(is_cuda=True, dtype=dtype, device="cuda:0", shape=(2, 16, 64, head_dim))


@pytest.mark.parametrize(
    ("capability", "dtype", "head_dim", "reason"),
    [
        ((9, 0), torch.bfloat16, 128, None),
        ((9, 0), torch.float16, 256, None),
        ((9, 0), torch.bfloat16, 8, None),
        ((10, 0), torch.bfloat16, 256, None),
        ((9, 0), torch.float32, 128, "bf16/fp16 only"),
        ((8, 0), torch.bfloat16, 128, "needs compute capability >= 9.0"),
        ((12, 0), torch.bfloat16, 128, "9.x-11.x only"),
        ((9, 0), torch.bfloat16, 264, "8 to 256 in multiples of 8"),
        ((9, 0), torch.bfloat16, 100, "8 to 256 in multiples of 8"),
        ((10, 0), torch.bfloat16, 192, "8 to 128, or 256"),
    ],
)
def test_what_the_backend_refuses(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
    reason: str | None,
) -> None:
    _capability_stand_in(monkeypatch, capability)
    got = fa4.flash_attn4_unsupported(_cuda_like(dtype, head_dim))
    assert got is None if reason is None else reason in str(got), got


def test_a_missing_package_or_a_cpu_tensor_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 4, 3, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(fa4, "INSTALLED", False)
    with pytest.raises(ValueError, match=r"'flash_attn4' cannot run .*: it needs the flash-attn-4 package"):
        select_attention_backend(q, "flash_attn4")
    monkeypatch.setattr(fa4, "INSTALLED", True)
    with pytest.raises(
        ValueError, match=r"'flash_attn4' cannot run torch.bfloat16 queries on cpu: it runs on CUDA"
    ):
        select_attention_backend(q, "flash_attn4")


@pytest.mark.parametrize(
    ("runs", "capability", "expected"),
    [(True, (9, 0), "flash_attn4"), (True, (10, 0), "sdpa_cudnn"), (False, (9, 0), "sdpa_cudnn")],
)
def test_auto_takes_it_first_where_it_runs_on_hopper(
    monkeypatch: pytest.MonkeyPatch, runs: bool, capability: tuple[int, int], expected: str
) -> None:
    """Measured ahead of cuDNN on Hopper (docs/benchmarks.md, runs G4 and U1): ``auto`` takes FA4 on
    compute capability 9.x where it runs, cuDNN on Blackwell (not measured) and where FA4 cannot run (not
    installed, a head dim it does not take). The CUDA checks are stood in for: this runs on CPU."""
    monkeypatch.setattr(fa4, "flash_attn4_unsupported", lambda q: None if runs else "stand-in: cannot run")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention_module, "_half_on_cuda", lambda q, minimum: None)
    names = attention_module.attention_backends()
    assert names.index("flash_attn4") < names.index("sdpa_cudnn")
    assert select_attention_backend(torch.randn(1, 4, 3, 8)).name == expected


def _site(root: Any, files: dict[str, str]) -> Any:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_each_flash_attention_is_found_without_importing_flash_attn(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FA4's wheel installs ``flash_attn`` as a namespace package holding ``cute`` only, beside the CuTe DSL
    (``cutlass.cute``); flash-attn 2 installs a regular ``flash_attn`` (whose ``__init__`` loads its CUDA extension)
    and the extension ``flash_attn_2_cuda``, and from 2.8 a ``flash_attn/cute`` without the DSL, which must not
    count as FA4 (on an H100 it did: ``auto`` took FA4, whose first call raised). Each is found by what only it has,
    no look-up imports ``flash_attn`` or ``cutlass``; with both installed in different folders, flash-attn 2's
    package hides FA4's ``cute`` (as an import would)."""
    raising = "raise RuntimeError('imported')\n"
    dsl = _site(tmp_path / "dsl", {"cutlass/__init__.py": raising, "cutlass/cute/__init__.py": ""})
    fa4_site = _site(tmp_path / "fa4", {"flash_attn/cute/__init__.py": ""})
    fa2_site = _site(tmp_path / "fa2", {"flash_attn/__init__.py": raising, "flash_attn_2_cuda.py": raising})
    fa2_8_site = _site(
        tmp_path / "fa2_8",
        {
            "flash_attn/__init__.py": raising,
            "flash_attn/cute/__init__.py": "",
            "flash_attn_2_cuda.py": raising,
        },
    )
    for path, fa4_found, fa2_found in (
        ([fa4_site, dsl], True, False),
        ([fa4_site], False, False),  # no CuTe DSL
        ([fa2_site, dsl], False, True),
        ([fa2_8_site], False, True),
        ([fa2_site, fa4_site, dsl], False, True),
    ):
        monkeypatch.setattr("sys.path", [str(p) for p in path])
        for name in ("flash_attn", "flash_attn_2_cuda", "cutlass"):
            monkeypatch.delitem(__import__("sys").modules, name, raising=False)
        assert fa4._cute_installed() is fa4_found, path
        assert attention_module._flash_attn_2_installed() is fa2_found, path


def test_a_compiled_block_holds_it_in_one_graph() -> None:
    """The attention block on the ``flash_attn4`` backend (its refusal bypassed: no CUDA here) compiles with
    ``fullgraph=True`` (the operators are opaque to Dynamo) and equals the eager block, gradients included."""
    register_attention_backend(
        AttentionBackend(
            "flash_attn4", attention_module._flash_attn4, lambda q: None, attention_module._never
        )
    )
    torch.manual_seed(0)
    block = Attention(32, 4, 2, 8)
    block.attention_backend = "flash_attn4"
    x = torch.randn(2, 7, 32, requires_grad=True)
    cos, sin = RotaryEmbedding(8, 16, 10000.0)(None, 7, x.dtype)
    expected = block(x, cos, sin)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    block.compile(fullgraph=True, backend="aot_eager")
    fa4_reference.CALLS.clear()
    out = block(x, cos, sin)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    assert fa4_reference.CALLS == ["forward", "backward"]
