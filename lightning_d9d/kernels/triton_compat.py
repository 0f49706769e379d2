"""``triton`` and ``triton.language`` when Triton is installed; otherwise stand-ins that let the kernel modules
import (``@triton.jit`` returns the function as it is) while the references run. Triton ships with torch on Linux
only, and :func:`lightning_d9d.kernels.dispatch.use_triton` never picks a kernel without it."""

from __future__ import annotations

from typing import Any


class _Missing:
    """Stands in for a Triton module: ``jit`` leaves the function alone; anything else names the fix."""

    def __init__(self, name: str) -> None:
        self._name = name

    @staticmethod
    def jit(fn: Any = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda inner: inner)

    def __getattr__(self, attribute: str) -> Any:
        raise RuntimeError(
            f"{self._name}.{attribute}: Triton is not installed (pip install triton, on Linux)"
        )


def _load() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language
    except ImportError:  # not Linux, or a torch built without it
        return _Missing("triton"), _Missing("triton.language")
    return triton, triton.language


triton, tl = _load()
AVAILABLE = not isinstance(triton, _Missing)
