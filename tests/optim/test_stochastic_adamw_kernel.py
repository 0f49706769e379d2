"""``StochasticAdamW``'s fused Triton step against its torch step, on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, ``LIGHTNING_D9D_KERNELS=triton``). The same checks at GPU sizes, bit for bit at any
settings, are tests/gpu/test_stochastic_adamw_gpu.py.

The kernel follows torch's CUDA kernels rounding for rounding. On CPU torch divides by the bias correction truly
(CUDA multiplies by its reciprocal), orders ``addcmul_`` otherwise, and its vectorized ``sqrt`` is not correctly
rounded, so the fp32 math agrees to the bit only where those are exact: ``EXACT`` settings make them so
(``beta2 = 0``: the second moment is the squared bf16 gradient, exact, its root exact, no bias correction; a
bias-corrected step size that is a power of two). Under them every tensor equals the torch step's bit for bit,
the bf16 ones rounded stochastically from values with more bits than bf16 keeps, so the random bits (seed, step,
stream, global index) decide them. Elsewhere (``test_any_settings_stay_within_an_fp32_rounding``) the two differ
by fp32 roundings only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_d9d.kernels import stochastic_adamw as kernel
from lightning_d9d.kernels.adamw import AdamWHyper
from lightning_d9d.optim import StochasticAdamW
from lightning_d9d.optim import stochastic_adamw as optimizer_module
from lightning_d9d.optim.stochastic_rounding import flat_global_index, stream_key

pytest.importorskip("triton")

LR = 2**-7
OPTIONS = [
    pytest.param({}, id="bf16-moments"),
    pytest.param({"moments_dtype": torch.float32}, id="fp32-moments"),
    pytest.param({"master_weights": True}, id="masters-bf16-moments"),
]
# (betas, steps, a random first moment before step 1). beta1 = 0.75 at step 1: the step size 4 lr, the first
# moment 0.75 m + 0.25 g (bits beyond bf16's); beta1 = 0 over 3 steps: the step size lr at every step, the step's
# number in the random bits.
EXACT = [
    pytest.param(((0.75, 0.0), 1, True), id="beta1=0.75-step1"),
    pytest.param(((0.0, 0.0), 3, False), id="beta1=0-3steps"),
]
# odd sizes, a 0-d tensor, and 2049 elements: one more than a program's block
SHAPES: list[tuple[int, ...]] = [(12, 8), (8,), (3, 5, 4), (), (2049,)]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def snapshot(params: list[Tensor], optimizer: StochasticAdamW) -> dict[str, Tensor]:
    state = {f"param.{i}": _local(p).detach().clone() for i, p in enumerate(params)}
    for i, param in enumerate(params):
        for key, value in optimizer.state[param].items():
            state[f"{key}.{i}"] = _local(value).detach().clone()
    return state


def train(
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    setting: tuple[tuple[float, float], int, bool],
    options: dict[str, Any],
    shapes: list[tuple[int, ...]] = SHAPES,
) -> dict[str, Tensor]:
    """``setting``'s steps over parameters of ``shapes`` (a clipping scale of 0.25, exact in fp32, at step 2),
    under ``LIGHTNING_D9D_KERNELS=mode``."""
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", mode)
    betas, steps, random_first_moment = setting
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16)) for s in shapes]
    optimizer = StochasticAdamW(params, lr=LR, betas=betas, weight_decay=0.1, seed=3, **options)
    if random_first_moment:
        for param in params:
            optimizer.state[param]["exp_avg"].copy_(torch.randn(param.shape, generator=generator))
    for step in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
        if step == 1:
            optimizer.scale_gradients(torch.tensor(0.25))
        optimizer.step()
    return snapshot(params, optimizer)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("setting", EXACT)
def test_the_fused_step_equals_the_torch_step_bit_for_bit(
    setting: tuple[tuple[float, float], int, bool], options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = train("reference", monkeypatch, setting, options)
    got = train("triton", monkeypatch, setting, options)
    assert got.keys() == expected.keys()
    different = {
        key: int((got[key] != value).sum()) for key, value in expected.items() if not got[key].equal(value)
    }
    assert different == {}


def test_the_bits_decide_the_bf16_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the bit-for-bit test: another seed's bits change the kernel's bf16 results (they are not
    values bf16 holds exactly, which any rounding would give alike)."""
    setting = ((0.75, 0.0), 1, True)
    ours = train("triton", monkeypatch, setting, {})
    monkeypatch.setattr(
        optimizer_module,
        "stream_key",
        lambda seed, step, stream: stream_key(seed=seed + 1, step=step, stream=stream),
    )
    other = train("triton", monkeypatch, setting, {})
    for key in ("param.0", "exp_avg.0", "exp_avg_sq.0", "param.4", "exp_avg.4", "exp_avg_sq.4"):
        assert float((ours[key] != other[key]).float().mean()) > 0.2, key


@pytest.mark.parametrize("options", OPTIONS)
def test_any_settings_stay_within_an_fp32_rounding(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdamW's usual settings (bias corrections, fp32 square roots) over 3 steps: fp32 results within a few fp32
    ulps of the torch step's (of the value, or of an update); a bf16 result differs only where such an ulp moved it across a rounding boundary
    (a chance of about 2**-16 an element), by one bf16 ulp."""
    setting = ((0.9, 0.999), 3, False)
    expected = train("reference", monkeypatch, setting, options)
    got = train("triton", monkeypatch, setting, options)
    for key, value in expected.items():
        if value.dtype == torch.float32:
            # a few fp32 ulps of the value, or of an update (about lr) where a weight near 0 cancels it
            torch.testing.assert_close(got[key], value, rtol=2**-20, atol=LR * 2**-20, msg=key)
        else:
            different = got[key] != value
            assert int(different.sum()) <= max(1, value.numel() // 1000), key
            gap = (got[key].float() - value.float()).abs()[different]
            ulp = value.float().abs()[different] * 2**-7
            assert bool((gap <= ulp).all()), key


# ------------------------------------------------------------------------------------------------ the global index
LAYOUTS = [  # (offsets, local shape, global shape, merged dims)
    pytest.param([0, 0], (12, 8), (12, 8), 1, id="whole"),
    pytest.param([5, 0], (4, 8), (12, 8), 1, id="rows"),
    pytest.param([0, 3], (12, 5), (12, 16), 2, id="columns"),
    pytest.param([0, 2, 0], (3, 2, 4), (3, 5, 4), 2, id="middle-dim"),
    pytest.param([1, 2, 1], (2, 2, 3), (3, 5, 4), 3, id="every-dim"),
    pytest.param([0, 3, 0, 0], (1, 1, 4, 2), (2, 5, 4, 2), 1, id="size-1-dims"),
    pytest.param([torch.tensor([0, 1, 4, 5]), 0], (4, 3), (8, 3), 2, id="strided-rows"),
    pytest.param([torch.tensor([0, 1, 4, 5]), 1], (4, 2), (8, 3), 2, id="strided-rows-columns"),
    pytest.param([2**33 + 5], (1000,), (2**34,), 1, id="index-above-2**32"),
    pytest.param([], (), (), 1, id="0-d"),
]


@pytest.mark.parametrize(("offsets", "local_shape", "global_shape", "dims"), LAYOUTS)
def test_a_shard_rounds_with_its_global_indices(
    offsets: list[int | Tensor], local_shape: tuple[int, ...], global_shape: tuple[int, ...], dims: int
) -> None:
    """The kernel on one shard's local part against the torch step's chunk at that part's global indices
    (``flat_global_index``, as the optimizer computes them), bit for bit under ``EXACT`` settings: rows (FSDP)
    and whole tensors merge to one dim, column (tp) shards take two, torch's strided shards a table."""
    index = kernel.global_index_layout(offsets, local_shape, global_shape)
    assert index is not None
    assert (
        sum(size != 1 or table is not None for size, table in zip(index.sizes, index.tables, strict=True))
        <= dims
    )
    generator = torch.Generator().manual_seed(1)
    numel = int(torch.Size(local_shape).numel())
    param = torch.randn(local_shape, generator=generator).to(torch.bfloat16)
    grad = torch.randn(local_shape, generator=generator).to(torch.bfloat16)
    exp_avg = torch.randn(local_shape, generator=generator).to(torch.bfloat16)
    exp_avg_sq = torch.zeros(local_shape, dtype=torch.bfloat16)
    hyper = AdamWHyper(lr=LR, beta1=0.75, beta2=0.0, eps=1e-8, weight_decay=0.1, step=1)
    keys = (
        stream_key(seed=3, step=1, stream=0),
        stream_key(seed=3, step=1, stream=1),
        stream_key(seed=3, step=1, stream=2),
    )
    expected = [t.clone().reshape(-1) for t in (param, exp_avg, exp_avg_sq)]
    torch_step = StochasticAdamW([nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))], seed=3)
    global_index = flat_global_index(offsets, local_shape, global_shape, 0, numel, param.device)
    torch_step._step_chunk(
        expected[0],
        {"exp_avg": expected[1], "exp_avg_sq": expected[2]},
        grad.reshape(-1),
        global_index,
        hyper,
        3,
        None,
    )
    kernel.stochastic_adamw_step_triton(param, grad, exp_avg, exp_avg_sq, None, hyper, keys, index)
    for name, got, want in zip(
        ("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), expected, strict=True
    ):
        assert torch.equal(got.reshape(-1), want), name


def test_more_than_three_unmerged_dims_take_the_torch_step() -> None:
    assert kernel.global_index_layout([1, 1, 1, 1], (2, 2, 2, 2), (3, 3, 3, 3)) is None
    assert kernel.global_index_layout([0, 0, 0, 1], (2, 2, 2, 2), (2, 2, 2, 3)) is not None  # three merge


def test_dtensor_shards_step_as_their_part_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer over DTensors (rank 2 of a 4-rank fake process group: local parts, no peers), the kernel
    forced: uneven FSDP rows, a tp column split, FSDP over tp (``_StridedShard``) and a 2-D split each equal
    their part of one process's torch step over the whole tensors, bit for bit, over 4 steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=2, world_size=4, store=FakeStore())  # the autouse guard destroys it
    flat_mesh = init_device_mesh("cpu", (4,))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = [
        ((10, 6), flat_mesh, [Shard(0)]),  # rows (3, 3, 3, 1): rank 2 holds 6-8
        ((6, 10), flat_mesh, [Shard(1)]),
        ((8, 3), mesh, [_StridedShard(0, split_factor=2), Shard(0)]),
        ((8, 6), mesh, [Shard(0), Shard(1)]),
        ((4, 6, 5), mesh, [Shard(1), Replicate()]),
    ]
    generator = torch.Generator().manual_seed(2)
    wholes = [torch.randn(shape, generator=generator).to(torch.bfloat16) for shape, _, _ in layouts]
    grads = [[torch.randn(w.shape, generator=generator).to(torch.bfloat16) for w in wholes] for _ in range(4)]

    def run(mode: str, sharded: bool) -> list[Tensor]:
        monkeypatch.setenv("LIGHTNING_D9D_KERNELS", mode)
        params = [
            nn.Parameter(distribute_tensor(w, mesh_, p, src_data_rank=None) if sharded else w.clone())
            for w, (_, mesh_, p) in zip(wholes, layouts, strict=True)
        ]
        optimizer = StochasticAdamW(params, lr=LR, betas=(0.0, 0.0), weight_decay=0.1, seed=3)
        for step_grads in grads:
            for param, grad, (_, mesh_, placements) in zip(params, step_grads, layouts, strict=True):
                param.grad = (
                    distribute_tensor(grad, mesh_, placements, src_data_rank=None) if sharded else grad
                )
            optimizer.step()
        return [p.detach() for p in params]

    calls: list[int] = []
    fused = kernel.stochastic_adamw_step_triton
    monkeypatch.setattr(
        optimizer_module, "stochastic_adamw_step_triton", lambda *a, **k: (calls.append(1), fused(*a, **k))
    )
    sharded = run("triton", sharded=True)
    assert len(calls) == 4 * len(layouts)
    whole = run("reference", sharded=False)
    assert len(calls) == 4 * len(layouts)
    for got, expected, (_, mesh_, placements) in zip(sharded, whole, layouts, strict=True):
        assert isinstance(got, DTensor)
        assert torch.equal(
            got.to_local(), distribute_tensor(expected, mesh_, placements, src_data_rank=None).to_local()
        )


# ------------------------------------------------------------------------------------------------ dispatch
def test_the_kernel_runs_where_the_dispatch_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors under ``auto`` and non-contiguous ones under ``triton`` take the torch step; contiguous CPU
    tensors in the interpreter under ``triton`` the kernel."""
    calls: list[int] = []
    fused = kernel.stochastic_adamw_step_triton
    monkeypatch.setattr(
        optimizer_module, "stochastic_adamw_step_triton", lambda *a, **k: (calls.append(1), fused(*a, **k))
    )
    contiguous = nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16))
    transposed = nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16).t())
    optimizer = StochasticAdamW([contiguous, transposed])
    for mode, expected in (("auto", 0), ("reference", 0), ("triton", 1)):
        monkeypatch.setenv("LIGHTNING_D9D_KERNELS", mode)
        for param in (contiguous, transposed):
            param.grad = torch.ones_like(param)
        calls.clear()
        optimizer.step()
        assert len(calls) == expected, mode


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
