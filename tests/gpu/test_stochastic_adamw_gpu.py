"""``StochasticAdamW``'s fused Triton step on one CUDA GPU: bit for bit the torch step at AdamW's usual settings
(the kernel follows torch's CUDA kernels rounding for rounding), in every option, at odd sizes and at a size the
torch step takes in several chunks; a shard's local part rounds with its global indices (rows, columns, torch's
strided shards, indices above 2**32); a tiny model trains with it. Once this passes,
``lightning_d9d.kernels.stochastic_adamw.STOCHASTIC_ADAMW_GPU_CHECKED`` may be set (``auto`` then runs the kernel
on CUDA). Speed is benchmarks/optimizer_speed.py's, not a test's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_d9d.kernels import stochastic_adamw as kernel
from lightning_d9d.kernels.adamw import AdamWHyper
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.optim import StochasticAdamW
from lightning_d9d.optim import stochastic_adamw as optimizer_module
from lightning_d9d.optim.stochastic_rounding import flat_global_index, stream_key

pytestmark = pytest.mark.gpu

OPTIONS = [
    pytest.param({}, id="bf16-moments"),
    pytest.param({"moments_dtype": torch.float32}, id="fp32-moments"),
    pytest.param({"master_weights": True}, id="masters-bf16-moments"),
    pytest.param({"master_weights": True, "moments_dtype": torch.float32}, id="masters-fp32-moments"),
]
# odd sizes, a 0-d tensor, a matrix, and 2**22 + 7 elements: more than one chunk of the torch step
SHAPES = [(1,), (), (1000,), (3, 5, 4), (1024, 1027), (2**22 + 7,)]


def train(
    mode: str, options: dict[str, Any], betas: tuple[float, float], monkeypatch: pytest.MonkeyPatch
) -> dict[str, Tensor]:
    """5 steps under ``LIGHTNING_D9D_KERNELS=mode`` (a clipping scale of 0.3 at step 2), two parameter groups."""
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", mode)
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [
        nn.Parameter(torch.randn(s, device="cuda", generator=generator).to(torch.bfloat16)) for s in SHAPES
    ]
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]
    optimizer = StochasticAdamW(groups, lr=1e-2, betas=betas, weight_decay=0.1, seed=11, **options)
    for step in range(5):
        for param in params:
            param.grad = torch.randn(param.shape, device="cuda", generator=generator).to(torch.bfloat16)
        if step == 2:
            optimizer.scale_gradients(torch.tensor(0.3, device="cuda"))
        optimizer.step()
    state = {f"param.{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, param in enumerate(params):
        state.update({f"{k}.{i}": v.clone() for k, v in optimizer.state[param].items() if k != "step"})
    return state


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)], ids=["betas-0.9-0.999", "beta1-0.3"])
@pytest.mark.parametrize("options", OPTIONS)
def test_the_fused_step_equals_the_torch_step_bit_for_bit(
    options: dict[str, Any], betas: tuple[float, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """beta1 = 0.3 takes lerp's other branch (weight 0.7 >= 0.5)."""
    calls: list[int] = []
    fused = kernel.stochastic_adamw_step_triton
    monkeypatch.setattr(
        optimizer_module, "stochastic_adamw_step_triton", lambda *a, **k: (calls.append(1), fused(*a, **k))
    )
    expected = train("reference", options, betas, monkeypatch)
    assert calls == []
    got = train("triton", options, betas, monkeypatch)
    assert len(calls) == 5 * len(SHAPES)
    different = {k: int((got[k] != v).sum()) for k, v in expected.items() if not torch.equal(got[k], v)}
    assert different == {}, (
        f"elements that differ, per tensor (of {expected['param.5'].numel()} in the largest)"
    )


LAYOUTS = [  # (offsets, local shape, global shape)
    pytest.param([4096, 0], (2048, 1027), (8192, 1027), id="rows"),
    pytest.param([0, 1000], (1024, 1001), (1024, 4096), id="columns"),
    pytest.param([1, 2, 3], (3, 300, 301), (8, 1000, 1000), id="every-dim"),
    pytest.param(["strided", 5], (2048, 1000), (4096, 1011), id="strided-rows-columns"),
    pytest.param([2**33 + 5], (2**20 + 3,), (2**34,), id="index-above-2**32"),
]


@pytest.mark.parametrize(("offsets", "local_shape", "global_shape"), LAYOUTS)
def test_a_shard_rounds_with_its_global_indices(
    offsets: list[Any], local_shape: tuple[int, ...], global_shape: tuple[int, ...]
) -> None:
    """The kernel on one shard's local part against the torch step's chunk at that part's global indices
    (``flat_global_index``), bit for bit; "strided": the rows torch's ``_StridedShard`` gives (two blocks of
    1024 rows, 2048 apart)."""
    offsets = [
        torch.cat([torch.arange(0, 1024), torch.arange(2048, 3072)]).cuda() if o == "strided" else o
        for o in offsets
    ]
    index = kernel.global_index_layout(offsets, local_shape, global_shape)
    assert index is not None
    generator = torch.Generator(device="cuda").manual_seed(1)
    param, grad = (
        torch.randn(local_shape, device="cuda", generator=generator).to(torch.bfloat16) for _ in "pg"
    )
    exp_avg = (0.1 * torch.randn(local_shape, device="cuda", generator=generator)).to(torch.bfloat16)
    exp_avg_sq = (0.01 * torch.rand(local_shape, device="cuda", generator=generator)).to(torch.bfloat16)
    hyper = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7)
    scale = torch.tensor([0.3], device="cuda")
    expected = [t.clone().reshape(-1) for t in (param, exp_avg, exp_avg_sq)]
    torch_step = StochasticAdamW([nn.Parameter(torch.zeros(1, device="cuda", dtype=torch.bfloat16))])
    numel = param.numel()
    torch_step._step_chunk(
        expected[0],
        {"exp_avg": expected[1], "exp_avg_sq": expected[2]},
        grad.reshape(-1),
        flat_global_index(offsets, local_shape, global_shape, 0, numel, param.device),
        hyper,
        5,
        scale,
    )
    keys = (
        stream_key(seed=5, step=7, stream=0),
        stream_key(seed=5, step=7, stream=1),
        stream_key(seed=5, step=7, stream=2),
    )
    kernel.stochastic_adamw_step_triton(param, grad, exp_avg, exp_avg_sq, None, hyper, keys, index, scale)
    for name, got, want in zip(
        ("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), expected, strict=True
    ):
        assert torch.equal(got.reshape(-1), want), f"{name}: {int((got.reshape(-1) != want).sum())} differ"


@pytest.mark.parametrize("options", OPTIONS[:1] + OPTIONS[2:3])
def test_a_tiny_model_trains_with_the_kernel(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer over a bf16 model on the GPU, the kernel forced: training lowers the loss on a repeated
    batch, every parameter stays bf16."""
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", "triton")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny()).cuda()
    model.init_weights()
    model.to(torch.bfloat16)
    optimizer = StochasticAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **options)
    tokens = torch.randint(0, Qwen3Config.tiny().vocab_size, (4, 33), device="cuda")
    losses = []
    for _ in range(10):
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())
