"""Shared by the CPU (Triton interpreter) and GPU kernel tests: inputs, poisoned outputs, error measure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN, so failing any bound, if ``out`` has an unwritten NaN)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Every ``torch.empty`` / ``torch.empty_like`` of a floating dtype made from Python in this block comes back
    full of NaN, so an output element a kernel forgets to write fails the error bound."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.dtype.is_floating_point else tensor

    def poisoned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like  # type: ignore[assignment]


def grads(
    outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], seed: int = 7
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``outputs`` against fixed random incoming gradients (the same for ours and the reference)."""
    generator = torch.Generator(device=outputs[0].device).manual_seed(seed)
    incoming = tuple(
        torch.randn(o.shape, generator=generator, device=o.device, dtype=torch.float32).to(o.dtype)
        for o in outputs
    )
    return torch.autograd.grad(outputs, inputs, incoming)


def leaf(
    *shape: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    scale: float = 1.0,
    shift: float = 0.0,
) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale + shift
    return x.to(dtype).requires_grad_()
