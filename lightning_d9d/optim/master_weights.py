"""AdamW that keeps fp32 master weights while the model holds, computes with and gets gradients in bf16.

``bf16-mixed`` without FSDP (``D9DStrategy(fsdp_on_one_rank=False)``) otherwise keeps fp32 parameters and lets
autocast cast each weight to bf16 in every forward and each bf16 weight gradient back to fp32 in backward: two
passes over the weights a step that this optimizer folds into its own one pass (Megatron's way of mixed
precision). The parameters become bf16 when the optimizer is built; their fp32 values move into the optimizer's
state as ``"master"``, beside ``"exp_avg"`` and ``"exp_avg_sq"``, so a checkpoint's optimizer section keeps them
(under each parameter's name, as DCP flattens it) and a resume is exact. The model's own state dict holds the
bf16 weights: that is what a Hugging Face export writes.

The embedding's output, and so the residual stream, is bf16 as under FSDP's mixed precision (fp32 parameters
under autocast keep an fp32 residual stream). Gradients are bf16 and sum in bf16 where they accumulate, which is
why the strategy refuses gradient accumulation and pipeline microbatches with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_d9d.kernels.adamw import AdamWHyper, adamw_master_step
from lightning_d9d.optim.gradient_scale import PendingGradientScale

# Where a parameter keeps its master between optimizers (a second ``fit`` builds a new optimizer over the same,
# already bf16, parameters and must find the fp32 values again).
_MASTER_ATTRIBUTE = "_lightning_d9d_master"


class MasterWeightAdamW(PendingGradientScale, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay; its defaults) over fp32 masters of bf16 parameters.

    Build it in ``configure_optimizers`` over the module's fp32 parameters, and train with
    ``Trainer(precision="bf16-mixed", strategy=D9DStrategy(fsdp_on_one_rank=False))`` on one device: the
    forward runs under bf16 autocast, as it does without this optimizer. Parameters sharded by FSDP or tensor
    parallelism (DTensors) are refused: FSDP keeps fp32 shards and casts at its all-gather already.

    ``amsgrad``, ``maximize``, ``foreach``, ``fused`` and ``capturable`` are not options: the step is one pass of
    its own per parameter (:func:`lightning_d9d.kernels.adamw.adamw_master_step`).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        for group in self.param_groups:
            refused = [
                key for key in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(key)
            ]
            if refused:
                raise ValueError(f"MasterWeightAdamW does not support {', '.join(refused)}: leave them unset")
            for param in group["params"]:
                self._adopt(param)

    def _adopt(self, param: Tensor) -> None:
        """Move ``param``'s fp32 values into its state as the master, make it bf16, and give it its state now:
        DCP maps a checkpoint's optimizer entries onto the state keys a new optimizer already has."""
        if isinstance(param, DTensor):
            raise TypeError(
                "MasterWeightAdamW takes plain (unsharded) parameters, got a DTensor of "
                f"{tuple(param.shape)} on {param.device_mesh}: with FSDP (the d9d strategy's default) use "
                "torch.optim.AdamW, whose fp32 shards FSDP casts at its all-gather; MasterWeightAdamW is for "
                "D9DStrategy(fsdp_on_one_rank=False) on one device"
            )
        master: Tensor | None = getattr(param, _MASTER_ATTRIBUTE, None)
        if master is None or master.shape != param.shape:
            if param.dtype != torch.float32:
                raise TypeError(
                    f"MasterWeightAdamW takes fp32 parameters (it keeps them as masters), got {param.dtype} of "
                    f"{tuple(param.shape)}: build the model in fp32 (Trainer(precision='bf16-mixed'), "
                    "not 'bf16-true')"
                )
            master = param.data
            setattr(param, _MASTER_ATTRIBUTE, master)
        with torch.no_grad():
            # bf16 only: the strategy's autocast is bf16, and fp16 would need loss scaling this step does not do
            param.data = master.to(torch.bfloat16)
        self.state[param] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format),
            "master": master,
        }

    def _parameters(self) -> Iterator[Tensor]:
        return chain.from_iterable(group["params"] for group in self.param_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = self._take_grad_scale()
        for group in self.param_groups:
            hypers: dict[int, AdamWHyper] = {}  # one per step count in the group (all alike, as a rule)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("MasterWeightAdamW does not support sparse gradients")
                state = self.state[param]
                state["step"] += 1
                step = int(state["step"].item())
                hyper = hypers.get(step)
                if hyper is None:
                    hyper = hypers[step] = _hyper(group, step)
                if grad_scale is not None and grad_scale.device != param.device:
                    grad_scale = grad_scale.to(param.device)
                adamw_master_step(
                    state["master"],
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    param,
                    hyper,
                    grad_scale,
                )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that the fp32 state stays fp32 (torch casts every floating state tensor but ``step`` to
        its parameter's dtype, bf16 here), and each parameter becomes its loaded master in bf16. A state without
        masters (saved by ``torch.optim.AdamW``) starts them from the parameters as loaded: rounded to bf16."""
        saved = {
            param_id: {k: v for k, v in entries.items() if k != "step" and isinstance(v, Tensor)}
            for param_id, entries in state_dict["state"].items()
        }
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for param_id, param in zip(saved_ids, self._parameters(), strict=True):
                state = self.state[param]
                if "master" not in saved.get(param_id, {}):
                    rank_zero_warn(
                        "MasterWeightAdamW loaded a state without fp32 master weights (torch.optim.AdamW's?): "
                        "the masters start from the parameters as loaded, rounded to bf16"
                    )
                    state["master"] = param.detach().to(torch.float32)
                for key, value in saved.get(param_id, {}).items():
                    state[key] = value.to(device=param.device, dtype=torch.float32)
                setattr(param, _MASTER_ATTRIBUTE, state["master"])
                param.copy_(state["master"])


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


def check_master_weight_run(
    optimizers: Iterable[object], *, precision: str, autocast: bool, accumulate: int, pipeline_degree: int
) -> None:
    """Refuse a run a :class:`MasterWeightAdamW` cannot train right, naming the setting and its fix: its bf16
    parameters need the forward under bf16 autocast, and its bf16 gradients must not sum over micro-steps."""
    if not any(isinstance(optimizer, MasterWeightAdamW) for optimizer in optimizers):
        return
    if precision != "bf16-mixed" or not autocast:
        raise ValueError(
            f"MasterWeightAdamW needs the forward under bf16 autocast: Trainer(precision='bf16-mixed') with "
            f"D9DStrategy(fsdp_on_one_rank=False) on one device (this run: precision={precision!r}"
            f"{'' if autocast else ', the model wrapped by FSDP'})"
        )
    if accumulate > 1:
        raise ValueError(
            f"MasterWeightAdamW with accumulate_grad_batches={accumulate}: its bf16 gradients would sum in bf16 "
            "over the micro-steps; use torch.optim.AdamW (fp32 gradients) to accumulate"
        )
    if pipeline_degree > 1:
        raise ValueError(
            f"MasterWeightAdamW with pp={pipeline_degree}: the pipeline's microbatch gradients would sum in bf16; "
            "use torch.optim.AdamW with pipelines"
        )
