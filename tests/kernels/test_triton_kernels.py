"""The Triton RMSNorm, SwiGLU and RoPE kernels equal their PyTorch references, forward and gradients, run on
CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``) at small shapes with non-power-of-two sizes; the
modules use them only where they should (``LIGHTNING_D9D_KERNELS``). The same checks at real shapes in bf16 run
on the GPU (tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from kernel_checks import grads, leaf, poisoned_allocations, relative_error

from lightning_d9d.kernels import (
    dispatch,
    grouped_mm,
    permute_tokens,
    unpermute_tokens,
    weigh_rows,
    weights_by_row,
)
from lightning_d9d.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from lightning_d9d.kernels.rope import rope_reference, rope_triton
from lightning_d9d.kernels.swiglu import (
    swiglu_reference,
    swiglu_triton,
    weighted_swiglu_reference,
    weighted_swiglu_triton,
)
from lightning_d9d.modules import RMSNorm, SwiGLU, apply_rotary

pytest.importorskip("triton")
# fp32: the kernels and the references differ in summation order only. bf16 in the interpreter: numpy has no
# bf16, and the interpreter truncates fp32 -> bf16 (up to 1 ulp, 2**-7 relative) where the GPU rounds.
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((5, 24), torch.float32),
        ((2, 3, 100), torch.float32),  # a row length that is not a power of two
        ((2, 3, 5, 16), torch.float32),  # q/k norm: [B, T, heads, head_dim]
        ((1000, 16), torch.float32),  # 32 tiles of 32 rows over 4 programs: the pipelined backward loop
        ((37, 48), torch.bfloat16),
    ],
)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = leaf(*shape, dtype=dtype, device="cpu", seed=1)
    w = leaf(shape[-1], dtype=dtype, device="cpu", seed=2, scale=0.1, shift=1.0)
    with poisoned_allocations():
        out = rms_norm_triton(x, w, 1e-6)
        got = grads((out,), (x, w))
    ref = rms_norm_reference(x, w, 1e-6)
    expected = grads((ref,), (x, w))
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert relative_error(out, ref) < BOUND[dtype]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[dtype]


def test_rms_norm_backward_pipelines_only_loops_long_enough() -> None:
    """Pipelined stages where each program loops over >= 6 tiles (the q/k-norm shape and hidden 4096 on an
    H200's 1056 programs: 7.8 and 15.5 tiles each), one stage at hidden 1024 (3.9); an int set forces it."""
    from lightning_d9d.kernels import rmsnorm

    programs = 1056
    assert rmsnorm._backward_stages(8192, programs) == rmsnorm.PIPELINED_STAGES > 1
    assert rmsnorm._backward_stages(16384, programs) == rmsnorm.PIPELINED_STAGES
    assert rmsnorm._backward_stages(4096, programs) == 1
    rmsnorm.BACKWARD_STAGES = 2
    try:
        assert rmsnorm._backward_stages(4096, programs) == 2
    finally:
        rmsnorm.BACKWARD_STAGES = None


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 7), torch.float32), ((2, 2500), torch.float32), ((999,), torch.bfloat16)]
)
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gate, up = (
        leaf(*shape, dtype=dtype, device="cpu", seed=3),
        leaf(*shape, dtype=dtype, device="cpu", seed=4),
    )
    with poisoned_allocations():
        out = swiglu_triton(gate, up)
        got = grads((out,), (gate, up))
    ref = swiglu_reference(gate, up)
    expected = grads((ref,), (gate, up))
    assert relative_error(out, ref) < BOUND[dtype]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[dtype]


@pytest.mark.parametrize(
    ("rows", "ffn", "dtype"),
    [(5, 7, torch.float32), (3, 1500, torch.float32), (37, 48, torch.bfloat16), (1030, 20, torch.float32)],
)
def test_weighted_swiglu(rows: int, ffn: int, dtype: torch.dtype) -> None:
    """The experts' SwiGLU with each row's routing weight, read in place from halves of one ``[rows, 2 * ffn]``
    projection (strided rows), against the reference: output and the gradients of the projection and of the
    weights (a per-row reduction). 1500 columns take two column blocks; 1030 rows several row tiles."""
    gate_up = leaf(rows, 2 * ffn, dtype=dtype, device="cpu", seed=3)
    weights = leaf(rows, dtype=dtype, device="cpu", seed=4)
    with poisoned_allocations():
        out = weighted_swiglu_triton(*gate_up.split(ffn, dim=-1), weights)
        got = grads((out,), (gate_up, weights))
    ref = weighted_swiglu_reference(*gate_up.split(ffn, dim=-1), weights)
    expected = grads((ref,), (gate_up, weights))
    assert relative_error(out, ref) < BOUND[dtype]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[dtype]


@pytest.mark.parametrize(
    ("batch", "q_heads", "k_heads", "seq", "head_dim", "table_batch", "dtype"),
    [
        (2, 4, 2, 5, 16, 1, torch.float32),
        (
            2,
            6,
            3,
            7,
            12,
            2,
            torch.float32,
        ),  # heads and half head_dim not powers of two; per-sequence positions
        (1, 3, 1, 4, 8, 1, torch.bfloat16),
    ],
)
def test_rope(
    batch: int, q_heads: int, k_heads: int, seq: int, head_dim: int, table_batch: int, dtype: torch.dtype
) -> None:
    # As the attention block makes them: [B, heads, T, D] views of [B, T, heads, D] projections.
    q = leaf(batch, seq, q_heads, head_dim, dtype=dtype, device="cpu", seed=5).transpose(1, 2)
    k = leaf(batch, seq, k_heads, head_dim, dtype=dtype, device="cpu", seed=6).transpose(1, 2)
    angles = torch.rand(table_batch, seq, head_dim // 2) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with poisoned_allocations():
        q_out, k_out = rope_triton(q, k, cos, sin)
        got = grads((q_out, k_out), (q, k))
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    expected = grads((q_ref, k_ref), (q, k))
    assert q_out.stride() == q_ref.stride() or q_out.stride() == q.stride()
    assert relative_error(q_out, q_ref) < BOUND[dtype]
    assert relative_error(k_out, k_ref) < BOUND[dtype]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[dtype]


def test_rope_refuses_mismatched_tables() -> None:
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"cos \(1, 4, 8\) must be \[1 or 2, 5, 8\]"):
        rope_triton(q, q, torch.ones(1, 4, 8), torch.ones(1, 5, 8))


def test_modules_use_the_references_on_cpu_unless_forced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(2, 3, 40)
    assert not dispatch.use_triton("rms_norm", x)  # auto: CUDA only
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.use_triton("rms_norm", x)
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="LIGHTNING_D9D_KERNELS='fast'"):
        dispatch.use_triton("rms_norm", x)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(dispatch, "_ANNOUNCED", set())
    torch.manual_seed(0)
    norm, mlp = RMSNorm(40), SwiGLU(40, 24)
    qk, table = torch.randn(2, 3, 4, 10), torch.randn(1, 4, 10)
    with caplog.at_level(logging.INFO, logger="lightning_d9d.kernels"):
        forced = (norm(x), mlp(x), apply_rotary(qk, qk, table.cos(), table.sin()))
        norm(x)
    assert caplog.text.count("rms_norm: Triton kernel") == 1  # logged once
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    reference = (norm(x), mlp(x), apply_rotary(qk, qk, table.cos(), table.sin()))
    torch.testing.assert_close(forced[0], reference[0])
    torch.testing.assert_close(forced[1], reference[1])
    torch.testing.assert_close(forced[2], reference[2])


# Where the routing weights are applied: by unpermute_tokens, or by the "experts" on each grouped row (what the
# MoE block does) and then summed unweighted.
WEIGHED = ("combine", "rows")


def _routed_through(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, weighed: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """permute -> a per-expert scaling (an "expert") -> unpermute, the weights applied where ``weighed`` says."""
    grouped, permutation = permute_tokens(hidden, indices)
    expert_rows = grouped * scale[indices.reshape(-1)[permutation.order]]
    if weighed == "rows":
        weighted = weigh_rows(expert_rows, weights_by_row(weights, permutation))
        return grouped, unpermute_tokens(weighted, permutation)
    return grouped, unpermute_tokens(expert_rows, permutation, weights)


def _moe_round_trip(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, weighed: str
):  # type: ignore[no-untyped-def]
    """The round trip's rows, output, and the gradients of hidden and weights."""
    grouped, out = _routed_through(hidden, indices, weights, scale, weighed)
    return (grouped, out, *grads((out,), (hidden, weights)))


@pytest.mark.parametrize("weighed", WEIGHED)
@pytest.mark.parametrize(
    ("tokens", "hidden_size", "top_k", "dtype"),
    [(7, 5, 3, torch.float32), (9, 1500, 2, torch.float32), (6, 40, 4, torch.bfloat16)],
)
def test_moe_permute_and_unpermute(
    tokens: int,
    hidden_size: int,
    top_k: int,
    dtype: torch.dtype,
    weighed: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    experts = 6
    generator = torch.Generator().manual_seed(tokens)
    hidden = leaf(tokens, hidden_size, dtype=dtype, device="cpu", seed=8)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator).requires_grad_()
    scale = torch.randn(experts, hidden_size, generator=generator).to(dtype)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with poisoned_allocations():
        got = _moe_round_trip(hidden, indices, weights, scale, weighed)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    expected = _moe_round_trip(hidden, indices, weights, scale, weighed)
    assert torch.equal(got[0], expected[0])  # a gather: bit for bit
    for out, ref in zip(got[1:], expected[1:], strict=True):
        assert relative_error(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("weighed", WEIGHED)
def test_moe_permutation_runs_its_kernels_inside_torch_compile(
    weighed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The permutation kernels are torch custom operators: a ``fullgraph`` compile keeps them in the graph (the
    other kernels give way to their references there) and AOT autograd runs their registered backward, equal
    to the reference's gradients."""
    tokens, hidden_size, top_k, experts = 11, 24, 3, 5
    generator = torch.Generator().manual_seed(3)
    hidden = leaf(tokens, hidden_size, dtype=torch.float32, device="cpu", seed=9)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator).requires_grad_()
    scale = torch.randn(experts, hidden_size, generator=generator)
    graph_ops: set[str] = set()

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graph_ops.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g.forward)(
            gm, example_inputs
        )

    def round_trip(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _routed_through(h, indices, w, scale, weighed)[1]

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    torch._dynamo.reset()
    compiled = torch.compile(round_trip, backend=recording_backend, fullgraph=True)
    with poisoned_allocations():
        out = compiled(hidden, weights)
        got = grads((out,), (hidden, weights))
    unpermute = "unpermute_rows" if weighed == "combine" else "sum_rows"
    assert {"lightning_d9d.permute_rows.default", f"lightning_d9d.{unpermute}.default"} <= graph_ops, (
        graph_ops
    )
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    ref = round_trip(hidden, weights)
    expected = grads((ref,), (hidden, weights))
    assert relative_error(out, ref) < BOUND[torch.float32]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[torch.float32]


@pytest.mark.parametrize(
    ("sizes", "k", "n", "dtype"),
    [
        ([0, 70, 0, 5, 1, 0], 40, 70, torch.float32),  # empty groups; a group and N wider than one tile
        ([3, 0, 9], 8, 12, torch.float32),
        ([17, 30], 48, 16, torch.float16),  # (bf16 on the GPU: the interpreter has no bf16 dot)
    ],
)
def test_triton_grouped_gemm(sizes: list[int], k: int, n: int, dtype: torch.dtype) -> None:
    x = leaf(sum(sizes), k, dtype=dtype, device="cpu", seed=21)
    w = leaf(len(sizes), k, n, dtype=dtype, device="cpu", seed=22, scale=0.3)
    group_sizes = torch.tensor(sizes)
    with poisoned_allocations():
        out = grouped_mm(x, w, group_sizes, backend="triton")
        got = grads((out,), (x, w))
    blocks = x.float().split(sizes)  # a row block times its group's matrix, in fp32
    ref = torch.cat([block @ w[g].float() for g, block in enumerate(blocks)])
    expected = grads((ref,), (x, w))
    assert relative_error(out, ref) < BOUND[dtype]
    for grad, want in zip(got, expected, strict=True):
        assert relative_error(grad, want) < BOUND[dtype]
    for group, size in enumerate(sizes):
        if size == 0:  # an expert with no token gets exactly zero gradient
            assert torch.count_nonzero(got[1][group]) == 0


def test_the_package_works_without_triton() -> None:
    """Triton is a dependency on Linux only: elsewhere the models run on the references."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from lightning_d9d.kernels import dispatch\n"
        "from lightning_d9d.modules import RMSNorm, SwiGLU\n"
        "assert not dispatch.triton_installed()\n"
        "x = torch.randn(2, 8, requires_grad=True)\n"
        "SwiGLU(8, 4)(RMSNorm(8)(x)).sum().backward()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
