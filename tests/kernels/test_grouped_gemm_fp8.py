"""The float8 grouped GEMM backend's CPU-checkable parts: the per-group padding to 16 rows, the column-major
weight layout, the contract handed to torchao's kernel (checked by a stand-in that asserts it), and the refusals.
The float8 numbers themselves run on a Hopper GPU: tests/gpu/test_fp8_experts_gpu.py."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.kernels import grouped_gemm as gg
from lightning_d9d.kernels import grouped_gemm_fp8 as fp8
from lightning_d9d.kernels import grouped_mm, loop_grouped_mm
from lightning_d9d.modules.moe import GroupedExperts

# ragged, empty groups first, in the middle and last, one already a multiple of 16, one over 16
SIZES = [[0, 3, 0, 16, 17, 1, 0], [5], [0, 0, 0], [32, 0], [0, 40]]


@pytest.mark.parametrize("sizes", SIZES)
def test_padding_puts_every_group_on_a_multiple_of_16_with_zeros_between(sizes: list[int]) -> None:
    x = torch.randn(sum(sizes), 4) + 10  # no row of zeros: every zero below is padding
    padded, rows, ends = fp8.pad_groups(x, torch.tensor(sizes))
    assert ends.dtype == torch.int32 and padded.shape[0] % 16 == 0
    assert all(int(end) % 16 == 0 for end in ends) and int(ends[-1]) == padded.shape[0]
    assert padded.shape[0] == -(-(sum(sizes) + 15 * len(sizes)) // 16) * 16  # from the shapes only
    torch.testing.assert_close(padded[rows], x, rtol=0, atol=0)
    starts = [0, *ends[:-1].tolist()]
    for group, size in enumerate(sizes):  # group g's rows open its padded group, zeros fill the rest
        first = sum(sizes[:group])
        assert rows[first : first + size].tolist() == list(range(starts[group], starts[group] + size))
        assert not padded[starts[group] + size : int(ends[group])].any()


def torchao_contract(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` requires (fp8_grouped_mm.py's asserts, and the
    offsets covering every row), then the product in full precision over those groups."""
    assert a.stride(1) == 1, "A row-major"
    assert b_t.stride(1) == 1 and b_t.stride(2) == b_t.shape[1], "B_t column-major per group"
    assert offs.dtype == torch.int32 and offs.shape == (b_t.shape[0],)
    assert all(int(end) % 16 == 0 for end in offs) and int(offs[-1]) == a.shape[0]
    starts = [0, *offs[:-1].tolist()]
    return torch.cat([a[s:e] @ b_t[g] for g, (s, e) in enumerate(zip(starts, offs.tolist(), strict=True))])


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("layout", ["row_major", "column_major"])
def test_padded_product_equals_the_grouped_product_and_its_gradients(sizes: list[int], layout: str) -> None:
    generator = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(sum(sizes), 16, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(sizes), 16, 32, generator=generator, dtype=torch.float64)
    if layout == "column_major":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    w.requires_grad_()
    group_sizes = torch.tensor(sizes)
    out = fp8.padded_grouped_mm(x, w, group_sizes, torchao_contract)
    expected = loop_grouped_mm(x, w, group_sizes)
    torch.testing.assert_close(out, expected)
    incoming = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, w), incoming)
    want = torch.autograd.grad(expected, (x, w), incoming)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


def test_column_major_copies_only_a_row_major_weight() -> None:
    w = torch.randn(3, 16, 32)
    laid = fp8.column_major(w)
    assert laid.stride() == (16 * 32, 1, 16) and torch.equal(laid, w)
    assert fp8.column_major(laid) is laid


def test_the_backend_refuses_cpu_and_auto_never_picks_it() -> None:
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16, dtype=torch.bfloat16)
    assert "CUDA" in str(fp8.fp8_grouped_gemm_unsupported(x, w))
    with pytest.raises(ValueError, match=r"'torchao_fp8' cannot run these inputs: .*CUDA"):
        grouped_mm(x, w, torch.tensor([1, 3]), backend="torchao_fp8")
    assert gg.select_grouped_gemm_backend(x, w, "auto").name != fp8.FLOAT8_BACKEND
    assert fp8.FLOAT8_BACKEND in gg.grouped_gemm_backends()


def test_the_experts_hand_the_float8_backend_their_weights_as_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Named ``torchao_fp8``, GroupedExperts hands its ``gate_up_proj`` and ``down_proj`` as held (row-major: the
    backend's ``column_major`` copies each once into torchao's layout, no copy of the experts' own before it); the
    products are the bf16 experts' (a stand-in backend that records the layout)."""
    monkeypatch.setattr(gg._REGISTRY, "backends", dict(gg._REGISTRY.backends))
    layouts: list[bool] = []

    def stand_in(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        layouts.append(w.stride(1) == 1)
        return loop_grouped_mm(x, w, sizes)

    gg.register_grouped_gemm_backend(
        gg.GroupedGemmBackend(fp8.FLOAT8_BACKEND, stand_in, lambda x, w: None, lambda x, w: False)
    )
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32)
    reference = GroupedExperts(4, 16, 32, gemm_backend="loop")
    reference.load_state_dict(experts.state_dict())
    experts.gemm_backend = fp8.FLOAT8_BACKEND
    x, sizes = torch.randn(21, 16), torch.tensor([5, 0, 9, 7])
    torch.testing.assert_close(experts(x, sizes), reference(x, sizes))
    assert layouts == [False, False]
