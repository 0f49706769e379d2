"""``StochasticAdamW`` on one process: stochastic rounding is unbiased (and round-to-nearest is not), the step is
torch's AdamW math in fp32, a resume from its state dict continues bit for bit, norm clipping goes into the step,
and the memory plan counts the state it holds."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_d9d.optim import StochasticAdamW
from lightning_d9d.optim.stochastic_rounding import random_bits16, stochastic_round_bf16
from lightning_d9d.plans.memory import optimizer_states_per_parameter, plan_memory
from lightning_d9d.strategies.precision import D9DPrecision

LR, DECAY = 1e-2, 0.1
OPTIONS = [
    pytest.param({}, id="bf16-moments"),
    pytest.param({"moments_dtype": torch.float32}, id="fp32-moments"),
    pytest.param({"master_weights": True}, id="masters-bf16-moments"),
    pytest.param({"master_weights": True, "moments_dtype": torch.float32}, id="masters-fp32-moments"),
]


# ------------------------------------------------------------------------------------------------ rounding
def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The distance between the two bf16 values around ``x`` (positive, normal fp32 ``x``)."""
    low = x.to(torch.bfloat16)
    low = torch.where(low.float() > x, torch.nextafter(low, torch.zeros_like(low)), low)
    return torch.nextafter(low, torch.full_like(low, math.inf)).float() - low.float()


def values_between_bf16_neighbours(count: int) -> torch.Tensor:
    """fp32 values 0.1 to 0.4 or 0.6 to 0.9 of a bf16 ulp above a bf16 value: round-to-nearest misses each by
    at least 0.1 ulp."""
    generator = torch.Generator().manual_seed(0)
    base = (torch.rand(count, generator=generator) * 8 - 4).to(torch.bfloat16).float()
    fraction = 0.1 + 0.3 * torch.rand(count, generator=generator) + 0.5 * (torch.arange(count) % 2)
    return base + fraction * bf16_ulp(base.abs()) * base.sign()


def test_a_rounding_lands_on_a_bf16_neighbour_and_the_mean_of_many_is_the_value() -> None:
    """Each draw rounds ``x`` to its lower or upper bf16 neighbour (an error below one ulp); up with probability
    p = (x - lower) / ulp, so the error is unbiased with variance p (1 - p) ulp**2 <= ulp**2 / 4. The mean of N
    independent draws (N steps of one element) is then within 5 ulp / (2 sqrt(N)) of ``x`` but with probability
    below 6e-7 each (5 standard deviations of a near-normal mean); the draws come from a fixed seed, so the check
    is deterministic. Round-to-nearest (the same value every draw) misses each ``x`` by >= 0.1 ulp: biased, and
    out of the bound (0.055 ulp at N = 2048)."""
    x = values_between_bf16_neighbours(32)
    ulp = bf16_ulp(x.abs())
    index = torch.arange(x.numel())
    draws = 2048
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(1, draws + 1):
        rounded = stochastic_round_bf16(x, random_bits16(index, seed=7, step=step, stream=0)).float()
        assert ((rounded - x).abs() < ulp).all()
        assert (rounded.to(torch.bfloat16).float() == rounded).all()
        total += rounded.double()
    bound = 5 * ulp.double() / (2 * math.sqrt(draws))
    assert ((total / draws - x.double()).abs() <= bound).all()
    nearest = x.to(torch.bfloat16).double()  # the control: every draw alike
    assert ((nearest - x.double()).abs() > bound).all()
    truncated = stochastic_round_bf16(x, torch.zeros_like(index, dtype=torch.int32)).double()
    assert ((truncated - x.double()).abs() > bound).all()


def test_the_bits_depend_on_seed_step_stream_and_index() -> None:
    index = torch.arange(4096)
    bits = random_bits16(index, seed=0, step=1, stream=0)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**16
    for other in (
        random_bits16(index, seed=1, step=1, stream=0),
        random_bits16(index, seed=0, step=2, stream=0),
        random_bits16(index, seed=0, step=1, stream=1),
        random_bits16(index + 1, seed=0, step=1, stream=0),
    ):
        assert float((other == bits).float().mean()) < 0.01
    assert torch.equal(bits, random_bits16(index, seed=0, step=1, stream=0))
    # uniform: 16 bins of 256 draws each, chi-square (15 degrees of freedom) below its 0.999 quantile 37.7
    counts = torch.bincount(bits >> 12, minlength=16).double()
    assert float(((counts - 256) ** 2 / 256).sum()) < 37.7


def test_infinities_and_nans_pass_unchanged() -> None:
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    rounded = stochastic_round_bf16(x, torch.full((4,), 2**16 - 1, dtype=torch.int32))
    assert rounded[0] == math.inf and rounded[1] == -math.inf and rounded[2].isnan() and rounded[3] == 1.0


# ------------------------------------------------------------------------------------------------ the step
def make_params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(12, 8), (8,), (3, 5, 4)]
    return [nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16)) for s in shapes]


def gradients(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator).to(torch.bfloat16) for p in params]


def scale_of(step: int) -> torch.Tensor | None:
    """Step 2's gradients are scaled (as norm clipping does): the scale goes into the step."""
    return torch.tensor(0.25) if step == 2 else None


def groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0, "lr": 2 * LR}]


def train(params: list[nn.Parameter], optimizer: StochasticAdamW, steps: range) -> None:
    for step in steps:
        for param, grad in zip(params, gradients(params, step), strict=True):
            param.grad = grad
        scale = scale_of(step)
        if scale is not None:
            optimizer.scale_gradients(scale)
        optimizer.step()
        optimizer.zero_grad()


def test_with_masters_and_fp32_moments_each_step_is_torch_adamw_on_the_masters() -> None:
    """Option (b) with fp32 moments is ``torch.optim.AdamW`` on fp32 masters bit for bit (same gradients, the
    clipping scale applied in fp32), the parameters the masters rounded to nearest."""
    params = make_params()
    masters = [p.detach().float().requires_grad_() for p in params]
    optimizer = StochasticAdamW(
        groups(params),
        lr=LR,
        betas=(0.9, 0.95),
        weight_decay=DECAY,
        master_weights=True,
        moments_dtype=torch.float32,
    )
    reference = torch.optim.AdamW(
        groups(masters), lr=LR, betas=(0.9, 0.95), weight_decay=DECAY, foreach=False
    )  # type: ignore[arg-type]
    for step in range(6):
        scale = scale_of(step)
        for param, master, grad in zip(params, masters, gradients(params, step), strict=True):
            param.grad = grad
            master.grad = grad.float() * (1.0 if scale is None else scale)
        if scale is not None:
            optimizer.scale_gradients(scale)
        optimizer.step()
        reference.step()
    for param, master in zip(params, masters, strict=True):
        state, expected = optimizer.state[param], reference.state[master]
        assert torch.equal(state["master"], master.detach())
        assert torch.equal(state["exp_avg"], expected["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"])
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))


def test_with_masters_and_bf16_moments_the_masters_track_torch_adamw() -> None:
    """bf16 moments (each rounding within one bf16 ulp, 2**-7 relative) move each update m / sqrt(v) by a few
    2**-7 relative at most; over 6 steps of size <= lr (bias-corrected Adam moves each weight by at most about lr a
    step) the masters stay within 6 * lr * 2**-4 of fp32 AdamW's."""
    params = make_params()
    masters = [p.detach().float().requires_grad_() for p in params]
    optimizer = StochasticAdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=DECAY, master_weights=True)
    reference = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.95), weight_decay=DECAY, foreach=False)
    for step in range(6):
        for param, master, grad in zip(params, masters, gradients(params, step), strict=True):
            param.grad, master.grad = grad, grad.float()
        optimizer.step()
        reference.step()
    for param, master in zip(params, masters, strict=True):
        assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
        difference = (optimizer.state[param]["master"] - master.detach()).abs().max()
        assert float(difference) <= 6 * LR * 2**-4
        assert float(difference) > 0  # the moments did round


def test_without_masters_updates_far_below_an_ulp_move_the_weights_in_expectation() -> None:
    """Option (a): 4096 weights at 1.0, a constant gradient and lr = 1e-4, so AdamW moves each by about lr a step
    while half a bf16 ulp at 1.0 is 2**-8 (39 lr): round-to-nearest (torch's AdamW over bf16 weights) never moves
    them; stochastic rounding moves their mean as fp32 would. After 100 steps fp32 AdamW is at w100; each weight's
    rounding errors are unbiased with variance <= ulp**2/4 a step (ulp = 2**-8 below 1.0), so the mean of 4096
    weights is within 5 * sqrt(100) * ulp / (2 * sqrt(4096)) of w100 (bf16 moments add their unbiased noise to the
    updates, within the same bound at this size)."""
    lr, steps = 1e-4, 100
    ours = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    nearest = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    fp32 = nn.Parameter(torch.ones(1))
    optimizers = [
        StochasticAdamW([ours], lr=lr, weight_decay=0.0),
        torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0, foreach=False),
        torch.optim.AdamW([fp32], lr=lr, weight_decay=0.0, foreach=False),
    ]
    for _ in range(steps):
        for param in (ours, nearest, fp32):
            param.grad = torch.full_like(param, 0.5)
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(nearest.detach(), torch.ones_like(nearest))
    bound = 5 * math.sqrt(steps) * 2**-8 / (2 * math.sqrt(4096))
    assert float(1.0 - fp32.detach()) > 5 * bound  # the expected move is far above the noise
    assert abs(float(ours.detach().float().mean() - fp32.detach())) <= bound


# ------------------------------------------------------------------------------------------------ resume
def state_of(params: list[nn.Parameter], optimizer: StochasticAdamW) -> dict[str, torch.Tensor]:
    state = {f"param.{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, param in enumerate(params):
        for key, value in optimizer.state[param].items():
            state[f"{key}.{i}"] = value.detach().clone()
    return state


@pytest.mark.parametrize("options", OPTIONS)
def test_a_resume_from_the_state_dict_continues_bit_for_bit(options: dict[str, Any]) -> None:
    """Train 3 steps, hand the parameters and the optimizer's state dict to a fresh optimizer (built with another
    seed: the saved one wins), train 3 more: equal to 6 uninterrupted steps."""
    params = make_params()
    optimizer = StochasticAdamW(groups(params), lr=LR, weight_decay=DECAY, seed=3, **options)
    train(params, optimizer, range(6))
    expected = state_of(params, optimizer)

    first = make_params()
    optimizer = StochasticAdamW(groups(first), lr=LR, weight_decay=DECAY, seed=3, **options)
    train(first, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    fresh = StochasticAdamW(groups(resumed), lr=LR, weight_decay=DECAY, seed=99, **options)
    fresh.load_state_dict(saved)
    assert [g["seed"] for g in fresh.param_groups] == [3, 3]
    train(resumed, fresh, range(3, 6))
    got = state_of(resumed, fresh)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key  # the load keeps the state's dtypes
        assert torch.equal(got[key], value), key


def test_another_seed_rounds_otherwise() -> None:
    """Without masters every weight takes the seed's rounding (with masters only the bf16 moments do)."""
    runs = []
    for seed in (0, 1):
        params = make_params()
        train(params, StochasticAdamW(params, lr=LR, seed=seed), range(3))
        runs.append(params)
    assert all(not torch.equal(a, b) for a, b in zip(*runs, strict=True))


# ------------------------------------------------------------------------------------------------ clipping
def test_norm_clipping_goes_into_the_step_and_equals_clipped_fp32_gradients() -> None:
    """The strategy's clipping hands the coefficient to the optimizer instead of rewriting the bf16 gradients, and
    the step with it equals one over gradients multiplied by it in fp32."""
    params = make_params()
    scaled = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = StochasticAdamW(params, lr=LR)
    control = StochasticAdamW(scaled, lr=LR)
    grads = gradients(params, 0)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    D9DPrecision("bf16-true").clip_grad_by_norm(optimizer, 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert optimizer._grad_scale is not None
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    coefficient = 0.5 / (norm + 1e-6)
    assert coefficient < 0.1  # the clipping bites
    torch.testing.assert_close(optimizer._grad_scale.double(), coefficient.reshape(1), rtol=1e-6, atol=0)
    for param, grad in zip(scaled, grads, strict=True):
        param.grad_dtype = None  # an fp32 gradient for a bf16 parameter: the control's clipped gradients
        param.grad = grad.float() * optimizer._grad_scale
    optimizer.step()
    control.step()
    assert all(torch.equal(a, b) for a, b in zip(params, scaled, strict=True))


def test_what_it_cannot_train_is_refused() -> None:
    with pytest.raises(TypeError, match=r"bf16 parameters.*precision='bf16-true'"):
        StochasticAdamW([nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match=r"moments_dtype=torch\.float16"):
        StochasticAdamW(make_params(), moments_dtype=torch.float16)


# ------------------------------------------------------------------------------------------------ memory plan
@pytest.mark.parametrize("options", OPTIONS)
def test_the_memory_plan_counts_the_state_it_holds(options: dict[str, Any]) -> None:
    params = make_params()
    frozen = nn.Parameter(torch.ones(5, dtype=torch.bfloat16), requires_grad=False)
    optimizer = StochasticAdamW([*params, frozen], lr=LR, **options)
    train(params, optimizer, range(3))
    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if key != "step"
    )
    plan = plan_memory(
        [*params, frozen],
        optimizer_states=optimizer_states_per_parameter(optimizer),
        config=None,
        activations=None,
    )
    assert plan.optimizer == held
    assert frozen not in optimizer.state


# ------------------------------------------------------------------------------------------------ chunking
def chunked_params(contiguous: bool = False) -> list[nn.Parameter]:
    """Sizes around a 7-element chunk (a remainder, one element, a 0-d tensor) and a non-contiguous parameter
    (or its contiguous copy)."""
    generator = torch.Generator().manual_seed(4)
    shapes = [(12, 8), (5,), (1,), (), (3, 5, 4)]
    params = [nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16)) for s in shapes]
    transposed = torch.randn(9, 6, generator=generator).to(torch.bfloat16).t()  # strides (1, 6)
    return [*params, nn.Parameter(transposed.contiguous() if contiguous else transposed)]


@pytest.mark.parametrize("options", OPTIONS)
def test_stepping_in_chunks_changes_no_bit(options: dict[str, Any]) -> None:
    """7 elements at a time (every parameter in several chunks, the last one short) against the whole parameter
    at once: the same parameters and state, bit for bit, over 4 steps (one with a clipping scale); and a
    non-contiguous parameter steps as its contiguous copy does."""
    runs = []
    for chunk, contiguous in ((7, False), (2**22, False), (7, True)):
        params = chunked_params(contiguous)
        assert params[-1].is_contiguous() == contiguous
        optimizer = StochasticAdamW(params, lr=LR, weight_decay=DECAY, chunk_elements=chunk, **options)
        train(params, optimizer, range(4))
        runs.append(state_of(params, optimizer))
    chunked, whole, contiguous_run = runs
    assert chunked.keys() == whole.keys() == contiguous_run.keys()
    for key, value in whole.items():
        assert torch.equal(chunked[key], value), key
        assert torch.equal(contiguous_run[key], value), key


def peak_bytes_of_a_step(elements: int, chunk: int, tmp_path: Any) -> int:
    """The most bytes the CPU allocator holds beyond what it held when one step of one parameter of ``elements``
    started (torch's profiler records every CPU allocation and free with ``profile_memory``)."""
    generator = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.randn(elements, generator=generator).to(torch.bfloat16))
    param.grad = torch.randn(elements, generator=generator).to(torch.bfloat16)
    optimizer = StochasticAdamW([param], chunk_elements=chunk)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        optimizer.step()
    trace = tmp_path / f"step_{elements}_{chunk}.json"
    prof.export_chrome_trace(str(trace))
    held = peak = 0
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("name") == "[memory]":
            held += event["args"]["Bytes"]
            peak = max(peak, held)
    return peak


def test_the_step_allocates_a_bounded_amount_per_chunk_whatever_the_parameter_size(tmp_path: Any) -> None:
    """Chunks of 2**12 elements: a parameter of 2**14 and one of 2**17 (32x more) peak at the same extra bytes,
    at most 52 bytes an element of a chunk (fp32 copies of weight, gradient and moments, int64 indices and hash;
    the step's state existed before it). Stepped whole, the 2**14-element parameter takes 4x the chunked peak:
    the measurement sees the temporaries."""
    chunk = 2**12
    small, large = (peak_bytes_of_a_step(n, chunk, tmp_path) for n in (2**14, 2**17))
    assert 0 < small <= 52 * chunk + 64, small
    assert large == small
    whole = peak_bytes_of_a_step(2**14, 2**22, tmp_path)
    assert whole >= 4 * (small - 64), whole
