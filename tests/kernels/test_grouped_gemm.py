"""Every grouped GEMM backend equals a row-by-row product (forward and both gradients) on ragged groups with
empty ones; the registry's choice, override, errors and log line."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch

from lightning_d9d.kernels import grouped_gemm as gg
from lightning_d9d.kernels import grouped_mm

# Empty groups first, in the middle and last; K and N multiples of 4 (torch's kernel needs 16-byte rows).
SIZES = [0, 3, 0, 5, 1, 0]


def rowwise_reference(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each row times its own group's matrix: no slicing into blocks, nothing shared with the backends."""
    groups = [group for group, size in enumerate(sizes) for _ in range(size)]
    return torch.stack([x[row] @ w[group] for row, group in enumerate(groups)]) if groups else x @ w[0]


def _inputs(sizes: list[int], k: int = 8, n: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(len(sizes) * 31 + sum(sizes))
    x = torch.randn(sum(sizes), k, generator=generator, requires_grad=True)
    w = torch.randn(len(sizes), k, n, generator=generator, requires_grad=True)
    return x, w, torch.tensor(sizes)


@pytest.mark.parametrize("backend", ["loop", "torch"])
@pytest.mark.parametrize("sizes", [SIZES, [4], [0, 0, 2], [0, 0, 0]])
def test_backend_equals_rowwise_product(backend: str, sizes: list[int]) -> None:
    x, w, group_sizes = _inputs(sizes)
    out = grouped_mm(x, w, group_sizes, backend=backend)
    expected = rowwise_reference(x, w, sizes)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(expected)
    grads = torch.autograd.grad(out, (x, w), grad_out, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, (x, w), grad_out, allow_unused=True)
    for grad, expected_grad, name in zip(grads, expected_grads, ("x", "w"), strict=True):
        expected_grad = torch.zeros_like(x if name == "x" else w) if expected_grad is None else expected_grad
        assert grad is not None, name
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5, msg=name)
    for group, size in enumerate(sizes):
        if size == 0:  # an expert with no token gets exactly zero gradient
            assert torch.count_nonzero(grads[1][group]) == 0  # type: ignore[index]


def test_loop_rejects_sizes_that_do_not_cover_the_rows() -> None:
    x, w, _ = _inputs(SIZES)
    with pytest.raises(ValueError, match=r"group_sizes sum to 8 but x has 9 rows"):
        grouped_mm(x, w, torch.tensor([0, 3, 0, 5, 0, 0]), backend="loop")
    with pytest.raises(ValueError, match=r"one count per group"):
        grouped_mm(x, w, torch.tensor([9]), backend="loop")


def test_auto_picks_the_loop_on_cpu_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(gg.ENV_VAR, raising=False)
    monkeypatch.setattr(gg._REGISTRY, "announced", set())
    x, w, _ = _inputs(SIZES)
    with caplog.at_level(logging.INFO, logger="lightning_d9d.kernels"):
        for _ in range(3):
            assert gg.select_grouped_gemm_backend(x, w).name == "loop"
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["grouped GEMM backend: loop (from auto)"]


def test_override_by_environment_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, _ = _inputs(SIZES)
    monkeypatch.setenv(gg.ENV_VAR, "torch")
    assert gg.select_grouped_gemm_backend(x, w).name == "torch"
    assert gg.select_grouped_gemm_backend(x, w, "loop").name == "loop"  # the argument wins over the variable
    monkeypatch.setenv(gg.ENV_VAR, "cutlass9000")
    with pytest.raises(ValueError, match=r"unknown grouped GEMM backend 'cutlass9000'.*'loop'"):
        gg.select_grouped_gemm_backend(x, w)
    odd = torch.randn(4, 6)  # 6 fp32 = 24 bytes: not a multiple of 16
    with pytest.raises(ValueError, match=r"'torch' cannot run.*multiple of 16 bytes.*K \(6\)"):
        gg.select_grouped_gemm_backend(odd, torch.randn(2, 6, 8), "torch")


def test_grouped_gemm_package_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, group_sizes = _inputs(SIZES)
    monkeypatch.delitem(sys.modules, "grouped_gemm", raising=False)
    monkeypatch.setattr(gg, "_GROUPED_GEMM_INSTALLED", False)
    with pytest.raises(ValueError, match=r"grouped_gemm package is not installed"):
        gg.select_grouped_gemm_backend(x, w, "grouped_gemm")
    monkeypatch.undo()

    # A stand-in package: the backend hands it bf16/CUDA-only inputs' operands and CPU int64 batch sizes.
    calls: list[tuple[torch.Size, torch.Size, torch.Tensor, bool]] = []

    def gmm(
        a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False
    ) -> torch.Tensor:
        calls.append((a.shape, b.shape, batch_sizes, trans_b))
        assert a.is_contiguous() and b.is_contiguous()  # the package's TORCH_CHECKs
        return gg.loop_grouped_mm(a, b.transpose(1, 2) if trans_b else b, batch_sizes)

    package = types.ModuleType("grouped_gemm")
    package.__spec__ = importlib.machinery.ModuleSpec("grouped_gemm", None)
    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = gmm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", ops)
    assert gg._grouped_gemm_installed()
    monkeypatch.setattr(gg, "_GROUPED_GEMM_INSTALLED", True)  # looked up at import, before the stand-in
    with pytest.raises(ValueError, match=r"bf16 on CUDA only"):
        gg.select_grouped_gemm_backend(x, w, "grouped_gemm")
    out = gg.package_grouped_mm(x, w, group_sizes)
    torch.testing.assert_close(out, rowwise_reference(x, w, SIZES))
    (a_shape, b_shape, batch_sizes, trans_b) = calls[0]
    assert (a_shape, b_shape, trans_b) == (x.shape, w.shape, False)
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64
    # transformers' layout: w the transposed view of a contiguous [G, N, K], handed over as that with trans_b
    w_nk = w.transpose(1, 2).contiguous()
    out = gg.package_grouped_mm(x, w_nk.transpose(1, 2), group_sizes)
    torch.testing.assert_close(out, rowwise_reference(x, w, SIZES))
    assert calls[-1][1:2] == (w_nk.shape,) and calls[-1][3] is True


def test_registered_backend_goes_first_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gg._REGISTRY, "backends", dict(gg._REGISTRY.backends))
    used: list[str] = []

    def run(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        used.append("mine")
        return gg.loop_grouped_mm(x, w, sizes)

    gg.register_grouped_gemm_backend(
        gg.GroupedGemmBackend("mine", run, lambda x, w: None, lambda x, w: True), before="torch"
    )
    assert gg.grouped_gemm_backends()[:2] == ("mine", "torch")
    x, w, group_sizes = _inputs(SIZES)
    grouped_mm(x, w, group_sizes, backend="auto")
    assert used == ["mine"]
    with pytest.raises(ValueError, match="reserved"):
        gg.register_grouped_gemm_backend(
            gg.GroupedGemmBackend("auto", run, lambda x, w: None, lambda x, w: True)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cuda_bf16_backend_equals_loop(backend: str) -> None:
    sizes = [0, 130, 7, 0, 300, 1, 64, 0]
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(sizes), 256, device="cuda", generator=generator).bfloat16().requires_grad_()
    w = (
        (torch.randn(len(sizes), 256, 384, device="cuda", generator=generator) / 16)
        .bfloat16()
        .requires_grad_()
    )
    group_sizes = torch.tensor(sizes, device="cuda")
    out = grouped_mm(x, w, group_sizes, backend=backend)
    expected = grouped_mm(x, w, group_sizes, backend="loop")
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w), grad_out)
    expected_grads = torch.autograd.grad(expected, (x, w), grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), expected_grad.float(), atol=5e-2, rtol=2e-2)
    if torch.cuda.get_device_capability()[0] in (9, 10):
        assert gg.select_grouped_gemm_backend(x, w).name == "torch"


def test_autocast_casts_the_operands_for_every_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast (bf16-mixed without FSDP) a backend receives operands in the autocast dtype, as a
    Linear would, and the fp32 inputs still get fp32 gradients: torch's grouped_mm, which autocast does not
    cover, refuses fp32 x bf16."""
    monkeypatch.setattr(gg._REGISTRY, "backends", dict(gg._REGISTRY.backends))
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def run(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        seen.append((x.dtype, w.dtype))
        return gg.loop_grouped_mm(x, w, sizes)

    gg.register_grouped_gemm_backend(
        gg.GroupedGemmBackend("recording", run, lambda x, w: None, lambda x, w: True)
    )
    x, w, group_sizes = _inputs(SIZES)
    x, w = x.float().requires_grad_(), w.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, group_sizes, backend="recording")
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("sizes", [SIZES, [0, 0, 0]])
def test_loop_traces_under_torch_compile(sizes: list[int]) -> None:
    """A compiled MoE block on CPU: the loop reads its group sizes on the host, which a fullgraph trace cannot,
    so inside torch.compile it runs as one custom operator with its own backward; values and gradients (empty
    groups included) equal the eager loop's."""
    x, w, group_sizes = _inputs(sizes)
    compiled = torch.compile(
        lambda a, b: grouped_mm(a, b, group_sizes, backend="loop"), backend="aot_eager", fullgraph=True
    )
    torch._dynamo.reset()
    out = compiled(x, w)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (x, w), upstream)
    expected = rowwise_reference(x, w, sizes) if sum(sizes) else gg.loop_grouped_mm(x, w, group_sizes)
    expected_grads = torch.autograd.grad(expected, (x, w), upstream, allow_unused=True)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad, leaf in zip(grads, expected_grads, (x, w), strict=True):
        torch.testing.assert_close(grad, torch.zeros_like(leaf) if expected_grad is None else expected_grad)


def test_loop_compiles_with_inductor_on_a_transposed_weight() -> None:
    """transformers' experts hand the grouped GEMM a transposed view of their ``[G, N, K]`` weight. Inductor checks
    each custom operator's outputs against the layout its fake kernel promised: the backward's weight gradient is
    a fresh contiguous tensor, so the fake must promise that, not the input's transposed strides (it did: an
    ``assert_size_stride`` failure in the first compiled backward of a transformers MoE at ep=2 on CPU)."""
    import torch._inductor.config as inductor_config

    x, w, group_sizes = _inputs(SIZES)
    stored = w.detach().transpose(1, 2).contiguous().requires_grad_()  # [G, N, K], as transformers keeps it
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: grouped_mm(a, b.transpose(1, 2), group_sizes, backend="loop"))
    # A graph cached before a change to the fake kernel would keep its old layout promise (the cache key misses
    # it). The config's own patch, not pytest's monkeypatch: monkeypatch's undo deletes the module attribute,
    # which leaves torch._inductor.config without fx_graph_cache for every later compile in the process.
    with inductor_config.patch(fx_graph_cache=False):
        out = compiled(x, stored)
        grad_x, grad_stored = torch.autograd.grad(out.square().sum(), (x, stored))
    expected = rowwise_reference(x, w, SIZES)
    expected_x, expected_w = torch.autograd.grad(expected.square().sum(), (x, w))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_x, expected_x)
    torch.testing.assert_close(grad_stored, expected_w.transpose(1, 2))


def test_choosing_a_backend_does_not_look_for_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` chooses inside compiled MoE blocks, where Dynamo (torch 2.11) refuses importlib's ``find_spec``: on
    an H100 an fp32 block failed to compile at the grouped_gemm package's check. Installed packages are looked up
    once, at import."""

    def find_spec(*args: object, **kwargs: object) -> None:
        raise AssertionError("find_spec called while choosing a grouped GEMM backend")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    x, w, _ = _inputs(SIZES)
    assert gg.select_grouped_gemm_backend(x, w).name == "loop"
