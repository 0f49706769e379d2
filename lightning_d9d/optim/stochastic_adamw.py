"""AdamW over bf16 parameters with bf16 state, unbiased through stochastic rounding.

Two ways to keep a bf16 model, both with ``Trainer(precision="bf16-true")`` and any mesh (FSDP, tp, ep, pp):

- ``master_weights=False`` (the default): no fp32 copy anywhere. Each step computes in fp32 and writes the
  parameter back to bf16 with stochastic rounding, so updates far below one bf16 ulp still move the weight in
  expectation (round-to-nearest would drop them). 2 + 2 + 2 bytes a parameter with bf16 moments (the default),
  2 + 4 + 4 with ``moments_dtype=torch.float32``.
- ``master_weights=True``: an fp32 master per parameter in the optimizer state (started from the bf16
  parameter), the parameter the master rounded to nearest; the moments still bf16 by default. 2 + 4 + 2 + 2 bytes.

bf16 moments are written with stochastic rounding too: the second moment's decay by ``beta2 = 0.999`` changes it
by less than half a bf16 ulp, so round-to-nearest would freeze it.

The random bits are a hash of ``(seed, step, stream, global element index)``
(:mod:`lightning_d9d.optim.stochastic_rounding`): the seed is a parameter-group setting and the step a per-parameter
counter, both in the optimizer's state dict, so a resume continues the same stream, and a sharded parameter rounds
as it does whole on one process. Parameters of one shape share their bits at one step (the index knows no
parameter): each rounding is still unbiased on its own.

DTensor parameters step on their local part (``to_local()``), their state being DTensors of the same placements,
so checkpoints save it sharded like torch's AdamW's. ``scale_gradients`` takes norm clipping's coefficient into
the next step (in fp32), as :class:`lightning_d9d.optim.MasterWeightAdamW` does.

Where Triton runs (:mod:`lightning_d9d.kernels.dispatch`), a parameter's local part steps in one fused pass with
the same bits (:mod:`lightning_d9d.kernels.stochastic_adamw`); elsewhere in chunks of torch operations.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels.adamw import AdamWHyper
from lightning_d9d.kernels.stochastic_adamw import (
    global_index_layout,
    stochastic_adamw_step_triton,
    use_stochastic_adamw_kernel,
)
from lightning_d9d.optim.gradient_scale import PendingGradientScale
from lightning_d9d.optim.stochastic_rounding import (
    axis_offsets,
    flat_global_index,
    random_bits16,
    stochastic_round_bf16,
    stream_key,
)

# Which random stream rounds which tensor of a step: independent bits for the weight and each moment.
_STREAMS = {"param": 0, "exp_avg": 1, "exp_avg_sq": 2}
_MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# Elements of a parameter's local part stepped at once: the step's temporaries (fp32 copies of the weight, the
# gradient and the moments, int64 indices and hash) peak at 52 bytes an element of a chunk (bf16 moments, no
# masters; measured by tests/optim/test_stochastic_adamw.py's chunking test), 208 MiB at 2**22, whatever the shard.
CHUNK_ELEMENTS = 2**22


class StochasticAdamW(PendingGradientScale, torch.optim.Optimizer):
    """``torch.optim.AdamW``'s math (decoupled weight decay, its order of operations, in fp32) over bf16
    parameters, writing bf16 results with stochastic rounding; see the module docstring for the two options.

    ``seed`` (an int, a parameter-group setting) picks the random stream. ``chunk_elements`` bounds the elements
    of a parameter's local part stepped at once, and with them the step's temporaries (the results do not depend
    on it). ``amsgrad``, ``maximize``, ``foreach``,
    ``fused`` and ``capturable`` are not options."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_weights: bool = False,
        moments_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        chunk_elements: int = CHUNK_ELEMENTS,
    ) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        if moments_dtype not in _MOMENT_DTYPES:
            raise ValueError(
                f"StochasticAdamW keeps its moments in bf16 or fp32, got moments_dtype={moments_dtype}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "seed": int(seed)}
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.moments_dtype = moments_dtype
        self.chunk_elements = chunk_elements
        for param in self._parameters():
            if param.dtype != torch.bfloat16:
                raise TypeError(
                    f"StochasticAdamW takes bf16 parameters, got {param.dtype} of {tuple(param.shape)}: train "
                    "with Trainer(precision='bf16-true'); for fp32 parameters use torch.optim.AdamW"
                )
        self.rebuild_state()  # state now: DCP maps a checkpoint's entries onto the keys it finds

    def has_stepped(self) -> bool:
        """Whether any parameter took a step (:class:`~lightning_d9d.optim.eager_state.EagerState`)."""
        return any(int(state["step"]) > 0 for state in self.state.values() if "step" in state)

    def rebuild_state(self) -> None:
        """Each trainable parameter's state as it starts (the masters from the parameters' values now), any other
        entry dropped: construction calls it, and ``fabric.setup(model, optimizer)`` again once sharding replaced
        the parameters (:class:`~lightning_d9d.optim.eager_state.EagerState`)."""
        self.state.clear()
        # the fused step's cache of where each parameter's shard lies, keyed by the parameters it held
        self.__dict__.pop("_index_layouts", None)
        for param in self._parameters():
            if param.requires_grad:
                self.state[param] = self._initial_state(param)

    @property
    def states_per_parameter(self) -> int:
        """Tensors of a (bf16) parameter's size the state holds per parameter: the memory plan's unit."""
        moment = 2 if self.moments_dtype == torch.float32 else 1
        return 2 * moment + (2 if self.master_weights else 0)

    def _initial_state(self, param: Tensor) -> dict[str, Tensor]:
        state = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, dtype=self.moments_dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(
                param, dtype=self.moments_dtype, memory_format=torch.preserve_format
            ),
        }
        if self.master_weights:
            state["master"] = param.detach().to(torch.float32, copy=True)
        return state

    def _parameters(self) -> Iterable[Tensor]:
        return chain.from_iterable(group["params"] for group in self.param_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = self._take_grad_scale()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("StochasticAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state.update(self._initial_state(param))
                state["step"] += 1
                step = int(state["step"].item())
                if grad_scale is not None and grad_scale.device != param.device:
                    grad_scale = grad_scale.to(param.device)
                self._step_one(param, state, _hyper(group, step), int(group["seed"]), grad_scale)
        return loss

    def _step_one(
        self,
        param: Tensor,
        state: dict[str, Tensor],
        hyper: AdamWHyper,
        seed: int,
        grad_scale: Tensor | None,
    ) -> None:
        """torch's single-tensor AdamW in fp32 on the local parts, then each bf16 result rounded stochastically;
        ``chunk_elements`` elements of the flattened local part at a time, so the fp32 and int64 temporaries
        stay bounded on any shard size (every operation is elementwise and the bits follow the global index:
        the chunking changes no bit of the result)."""
        grad = param.grad
        assert grad is not None
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        keys = ("exp_avg", "exp_avg_sq", "master") if self.master_weights else ("exp_avg", "exp_avg_sq")
        if self._step_fused(
            param, _local(grad), [_local(state[key]) for key in keys], hyper, seed, grad_scale
        ):
            return
        local = _local(param)
        written = [local, *(_local(state[key]) for key in keys)]
        flat = [_flat(tensor) for tensor in written]
        flat_grad = _local(grad).reshape(-1)
        offsets = axis_offsets(param)
        shape, local_shape = tuple(param.shape), tuple(local.shape)
        numel = local.numel()
        for start in range(0, numel, self.chunk_elements):
            end = min(start + self.chunk_elements, numel)
            index = flat_global_index(offsets, local_shape, shape, start, end, local.device)
            weight, *moments = (tensor[start:end] for tensor in flat)
            self._step_chunk(
                weight,
                dict(zip(keys, moments, strict=True)),
                flat_grad[start:end],
                index,
                hyper,
                seed,
                grad_scale,
            )
        for tensor, flattened in zip(written, flat, strict=True):
            if flattened.data_ptr() != tensor.data_ptr():  # a non-contiguous tensor stepped through a copy
                tensor.copy_(flattened.view(tensor.shape))

    def _step_fused(
        self,
        param: Tensor,
        grad: Tensor,
        state: list[Tensor],
        hyper: AdamWHyper,
        seed: int,
        grad_scale: Tensor | None,
    ) -> bool:
        """The whole local part in one Triton pass (:mod:`lightning_d9d.kernels.stochastic_adamw`, the same bits
        as :meth:`_step_chunk`) where the kernel runs on these tensors; False (nothing done) elsewhere."""
        local = _local(param)
        if not use_stochastic_adamw_kernel(local, grad, *state):
            return False
        # where the local part lies never changes for a parameter: computed once (axis_offsets' DTensor
        # arithmetic costs more host time than the kernel's launch); the cache is not state (not saved)
        layouts = self.__dict__.setdefault("_index_layouts", {})
        if param not in layouts:
            layouts[param] = global_index_layout(axis_offsets(param), tuple(local.shape), tuple(param.shape))
        index = layouts[param]
        if index is None:
            return False
        exp_avg, exp_avg_sq, *master = state
        param_key, exp_avg_key, exp_avg_sq_key = (
            stream_key(seed=seed, step=hyper.step, stream=stream) for stream in _STREAMS.values()
        )
        keys = (param_key, exp_avg_key, exp_avg_sq_key)
        stochastic_adamw_step_triton(
            local, grad, exp_avg, exp_avg_sq, master[0] if master else None, hyper, keys, index, grad_scale
        )
        return True

    def _step_chunk(
        self,
        param: Tensor,
        state: dict[str, Tensor],
        grad: Tensor,
        index: Tensor,
        hyper: AdamWHyper,
        seed: int,
        grad_scale: Tensor | None,
    ) -> None:
        """One chunk of flat elements (views into the parameter and its state) and their global indices."""

        def store(target: Tensor, value: Tensor, stream: str) -> None:
            if target.dtype == torch.bfloat16:
                bits = random_bits16(index, seed=seed, step=hyper.step, stream=_STREAMS[stream])
                target.copy_(stochastic_round_bf16(value, bits))
            elif target is not value:
                target.copy_(value)

        g = grad.to(torch.float32)
        if grad_scale is not None:
            g = g * grad_scale
        master = state.get("master")
        weight = master if master is not None else param.to(torch.float32)
        exp_avg, exp_avg_sq = (state[key].to(torch.float32) for key in ("exp_avg", "exp_avg_sq"))
        weight.mul_(hyper.decay)
        exp_avg.lerp_(g, 1.0 - hyper.beta1)
        exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
        denom = (exp_avg_sq.sqrt() / hyper.bias_correction2_sqrt).add_(hyper.eps)
        weight.addcdiv_(exp_avg, denom, value=-hyper.step_size)
        store(state["exp_avg"], exp_avg, "exp_avg")
        store(state["exp_avg_sq"], exp_avg_sq, "exp_avg_sq")
        if master is not None:
            param.copy_(master)  # round to nearest: the master keeps what rounding drops
        else:
            store(param, weight, "param")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that the state keeps its own dtypes (torch casts every floating state tensor but
        ``step`` to its parameter's dtype, bf16 here): the moments ``moments_dtype``, the masters fp32. A state
        without masters starts them from the parameters as loaded; masters in a state that needs none go."""
        saved = {
            param_id: {k: v for k, v in entries.items() if k != "step" and isinstance(v, Tensor)}
            for param_id, entries in state_dict["state"].items()
        }
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for param_id, param in zip(saved_ids, self._parameters(), strict=True):
                if param_id not in saved:
                    continue
                state = self.state[param]
                for key, value in saved[param_id].items():
                    dtype = torch.float32 if key == "master" else self.moments_dtype
                    state[key] = value.to(device=param.device, dtype=dtype)
                if self.master_weights and "master" not in state:
                    state["master"] = param.detach().to(torch.float32, copy=True)
                if not self.master_weights:
                    state.pop("master", None)


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _flat(tensor: Tensor) -> Tensor:
    """A flat view of a tensor the step writes, or a flat copy of a non-contiguous one (written back after)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def _hyper(group: dict[str, Any], step: int) -> AdamWHyper:
    beta1, beta2 = group["betas"]
    return AdamWHyper(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        step=step,
    )
