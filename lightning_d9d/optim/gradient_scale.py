"""Norm clipping's coefficient held for the optimizer's next step, for optimizers over bf16 gradients."""

from __future__ import annotations

from torch import Tensor


class PendingGradientScale:
    """Takes a scale of the gradients (one element, e.g. norm clipping's coefficient) for the next step, applied
    there in fp32, instead of rewriting the bf16 gradients now (which would round them twice). Scales given before
    one step multiply. Mixed into an optimizer; its ``step`` calls :meth:`_take_grad_scale` once."""

    _grad_scale: Tensor | None = None

    def scale_gradients(self, scale: Tensor) -> None:
        scale = scale.detach().float().reshape(1)
        self._grad_scale = scale if self._grad_scale is None else self._grad_scale * scale

    def _take_grad_scale(self) -> Tensor | None:
        """The pending scale (None: none), cleared for the step after."""
        scale, self._grad_scale = self._grad_scale, None
        return scale
