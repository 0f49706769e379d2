"""The strategy's precision plugin: FSDP2 mixed precision instead of autocast, and mesh-aware clipping."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast, get_args, overload

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_d9d.optim.gradient_scale import PendingGradientScale
from lightning_d9d.strategies.accumulation import StepTokens
from lightning_d9d.strategies.grad_norm import clip_grad_norm_, clip_grad_value_

if TYPE_CHECKING:
    import lightning.pytorch as pl

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


def convert_fp_tensor(tensor: torch.Tensor, dst_type: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dst_type`` if it is floating point; other tensors (token ids, masks) as they are."""
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


class DtypeContextManager:
    """torch's default dtype is ``dtype`` inside (tensors and modules created there take it)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self._previous = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc_info: object) -> None:
        torch.set_default_dtype(self._previous)


def check_precision(precision: str) -> PrecisionName:
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by the d9d strategy; "
            f"choose one of {', '.join(SUPPORTED_PRECISIONS)} (Trainer(precision=...))."
        )
    return cast(PrecisionName, precision)


class D9DPrecisionBase(FabricPrecision):
    """What the d9d strategies' precision means, under the Trainer and under Fabric alike.

    - ``32-true``: fp32 everywhere.
    - ``bf16-mixed``: fp32 master parameters; FSDP2 casts them to bf16 for compute and reduces gradients in
      fp32 (``MixedPrecisionPolicy``). No autocast: it would also wrap pipeline backward passes and cast
      where the model deliberately keeps fp32 (norms, loss). Only a model left without FSDP (one rank,
      ``fsdp_on_one_rank=False``) runs its forward under bf16 autocast: ``autocast_device``.
    - ``bf16-true``: parameters, gradients and optimizer state in bf16.
    """

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = check_precision(precision)  # type: ignore[assignment]
        # Set by the strategy for a bf16-mixed model that no FSDP unit casts: forward runs under autocast.
        self.autocast_device: str | None = None

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    def mixed_precision_policy(self) -> MixedPrecisionPolicy | None:
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return None

    @override
    def convert_module(self, module: Module) -> Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        if self.precision == "bf16-true":
            return DtypeContextManager(torch.bfloat16)
        return nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        autocast: AbstractContextManager = (
            torch.autocast(self.autocast_device, dtype=torch.bfloat16)
            if self.precision == "bf16-mixed" and self.autocast_device is not None
            else nullcontext()
        )
        with self.tensor_init_context(), autocast:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(
                data, function=convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16
            )
        return data


class D9DPrecision(D9DPrecisionBase, Precision):
    """Precision for ``Trainer(strategy="d9d")`` (see :class:`D9DPrecisionBase` for what each name means).

    Norm and value clipping group parameters by device mesh and reduce over ``norm_reduce_groups`` (the
    pipeline group when pipelining), so they are correct for any mix of DTensor layouts.
    """

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__(precision)
        self.norm_reduce_groups: Sequence[dist.ProcessGroup | None] = ()
        # Token-weighted gradient accumulation (the strategy counts, optimizer_step rescales).
        self.step_tokens = StepTokens()

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Lightning's: the closure (the step's last forward and backward), then ``on_before_optimizer_step``
        and clipping, then the step; with the gradients rescaled to the step's token mean (see
        :class:`StepTokens`) right after the closure."""

        def closure_then_rescale() -> Any:
            result = closure()
            self.step_tokens.rescale(self.main_params(cast(Optimizer, optimizer)))
            return result

        return super().optimizer_step(optimizer, model, closure_then_rescale, **kwargs)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(
            self.main_params(optimizer),
            float(clip_val),
            extra_groups=self.norm_reduce_groups,
            scale_in_step=master_weight_scale(optimizer),
        )

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_value_(self.main_params(optimizer), float(clip_val))


def master_weight_scale(optimizer: Optimizer) -> Callable[[Tensor], None] | None:
    """Where norm clipping hands its coefficient: a ``MasterWeightAdamW`` or ``StochasticAdamW`` applies it in its
    step (in fp32, rather than a pass rewriting bf16 gradients)."""
    if isinstance(optimizer, PendingGradientScale):
        return optimizer.scale_gradients
    return None


def as_trainer_precision(plugin: Precision) -> D9DPrecision:
    """The Trainer strategy's plugin for ``plugin``: a :class:`D9DPrecision` stays; one of Lightning's own, chosen
    from ``Trainer(precision=...)``, keeps its choice with our mechanism (an unsupported name refused by name)."""
    if isinstance(plugin, D9DPrecision):
        return plugin
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        return D9DPrecision(str(getattr(plugin, "precision", "32-true")))
    raise TypeError(
        f"the d9d strategy brings its own precision plugin and cannot use {type(plugin).__name__}; pass "
        "Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true') instead of a plugin"
    )


def as_fabric_precision(plugin: FabricPrecision) -> D9DPrecisionBase:
    """The Fabric strategy's plugin for ``plugin``: a :class:`D9DPrecisionBase` stays; one of Fabric's own, chosen
    from ``Fabric(precision=...)`` with a name we support, keeps its choice with our mechanism."""
    if isinstance(plugin, D9DPrecisionBase):
        return plugin
    name = getattr(plugin, "precision", "32-true")
    fabric_plugins = (FabricPrecision, FabricMixedPrecision, FabricHalfPrecision)
    if type(plugin) in fabric_plugins and name in SUPPORTED_PRECISIONS:
        return D9DPrecisionBase(str(name))
    raise TypeError(
        f"the d9d strategy brings its own precision plugin and cannot use {type(plugin).__name__} "
        f"(precision={name!r}); pass Fabric(precision='32-true' | 'bf16-mixed' | 'bf16-true')"
    )


PluginT = TypeVar("PluginT", bound=D9DPrecisionBase)


class PrecisionSlot(Generic[PluginT]):
    """A strategy's precision plugin property (the Trainer's ``precision_plugin``, Fabric's ``precision``), stored
    in the ``attribute`` Lightning keeps it in: whatever Lightning sets goes through ``convert``, and the first read
    without one converts ``default()``. Kept, not made anew on each read: the strategy sets state on it (the
    autocast device, the norm-reduce groups)."""

    def __init__(self, attribute: str, convert: Callable[[Any], PluginT], default: Callable[[], Any]) -> None:
        self.attribute, self.convert, self.default = attribute, convert, default

    @overload
    def __get__(self, strategy: None, owner: type) -> PrecisionSlot[PluginT]: ...

    @overload
    def __get__(self, strategy: object, owner: type) -> PluginT: ...

    def __get__(self, strategy: object | None, owner: type) -> PrecisionSlot[PluginT] | PluginT:
        if strategy is None:
            return self
        current = getattr(strategy, self.attribute)
        plugin = self.convert(current or self.default())
        if plugin is not current:
            setattr(strategy, self.attribute, plugin)
        return plugin

    def __set__(self, strategy: object, plugin: Any | None) -> None:
        setattr(strategy, self.attribute, None if plugin is None else self.convert(plugin))
