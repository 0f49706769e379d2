"""Muon for the hidden matrices of a model, AdamW for the rest, in one optimizer that knows our shards.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/) keeps a momentum buffer per matrix
(Nesterov by default), replaces each update by an approximately orthogonal matrix (five steps of a quintic
Newton–Schulz iteration, :func:`newton_schulz`), scales it by the matrix's shape (:func:`lr_scale`) and applies
it with decoupled weight decay. A stacked-experts parameter ``[E, in, out]`` is orthogonalised expert by expert.
Embeddings, the LM head, norms, biases and routers take AdamW steps instead (torch's ``AdamW`` update, the same
state keys). Which parameter takes which is the ``use_muon`` flag of its parameter group;
:func:`muon_param_groups` splits a model's named parameters by a rule (:func:`default_muon_rule` unless given).

Sharded parameters (DTensors: FSDP2 ``Shard(0)``, tensor-parallel ``Shard(0)``/``Shard(1)``, expert-parallel)
are supported. Newton–Schulz needs the whole matrix: each rank gathers the momentum-updated matrix
(``full_tensor()``), runs the iteration on it, and keeps its own shard of the result (a local slice, in the
parameter's placements), so every rank computes the same orthogonal update. Communication per step: one
all-gather of each sharded Muon matrix, the size of the whole matrix; none for AdamW parameters and none for
stacked experts sharded only over the expert dimension (every rank holds whole experts). Every rank runs the
iteration on every matrix: assigning whole matrices to ranks would divide that work, and is not done here.

The state (``momentum_buffer`` for Muon parameters; ``step``, ``exp_avg``, ``exp_avg_sq`` for AdamW ones) is made
of tensors shaped and sharded like the parameters, so it saves and resumes through the training checkpoint
as torch's AdamW does, on any mesh (DCP reshards).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic's ``(a, b, c)`` in ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` (Keller Jordan's)."""
NS_STEPS = 5
NS_EPS = 1e-7  # the Frobenius norm's floor: a zero update stays zero

LrScaling = Literal["match_rms_adamw", "original"]
"""How a Muon update is scaled by its matrix's shape ``[rows, cols]`` (the last two dims):

- ``"match_rms_adamw"`` (default): ``0.2 * sqrt(max(rows, cols))``, from Moonshot's "Muon is Scalable for LLM
  Training" (https://arxiv.org/abs/2502.16982): the update's RMS matches AdamW's typical 0.2-0.4, so one
  learning rate and weight decay serve the Muon and the AdamW parameters alike.
- ``"original"``: ``max(1, rows / cols) ** 0.5``, Keller Jordan's (his code reads ``size(-2) / size(-1)``, which
  for an ``nn.Linear`` weight ``[out, in]`` is fan-out over fan-in; for stacked experts ``[E, in, out]`` it is
  in over out, as stored). Learning rates are Muon's own then (about 0.02).

Both are ``torch.optim.Muon``'s ``adjust_lr_fn`` options of the same names.
"""


def newton_schulz(
    matrix: Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """An approximately orthogonal ``U S' V^T`` for ``matrix = U S V^T`` (``[..., rows, cols]``, batched over the
    leading dims), in ``matrix``'s dtype.

    Each matrix is divided by its Frobenius norm (so its singular values are at most 1), transposed when it has
    more rows than columns (the Gram matrix is then the smaller one), and iterated ``steps`` times in ``dtype``
    (default: bf16 on CUDA, fp32 elsewhere). The iteration maps each singular value ``s`` by the polynomial
    ``a s + b s^3 + c s^5`` and leaves the singular vectors alone. Keller Jordan's coefficients push small
    singular values up fast and do not converge to 1: singular values not too small end in a band around 1
    (about 0.68-1.2; tests/optim/test_muon.py derives it from the coefficients).
    """
    if matrix.ndim < 2:
        raise ValueError(
            f"newton_schulz takes a matrix or a stack of matrices, got shape {tuple(matrix.shape)}"
        )
    a, b, c = coefficients
    compute = dtype or (torch.bfloat16 if matrix.device.type == "cuda" else torch.float32)
    x = matrix.to(compute)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        if x.ndim == 2:  # addmm: the same rounding as torch.optim.Muon's
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


def lr_scale(shape: Iterable[int], rule: LrScaling = "match_rms_adamw") -> float:
    """The factor on the learning rate of a Muon update of a matrix of ``shape`` (the last two dims count; see
    :data:`LrScaling`)."""
    rows, cols = tuple(shape)[-2:]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"lr_scaling must be one of {get_args(LrScaling)}, got {rule!r}")


def default_muon_rule(name: str, param: Tensor) -> bool:
    """Muon for the 2-D and 3-D weights inside the decoder blocks (``.layers.`` in the name), except a router
    (a module named ``gate``; ``gate_proj`` is an MLP weight) and anything named like an embedding or LM head;
    AdamW for everything else (embeddings, the head, norms, biases, 1-D)."""
    parts = name.split(".")
    return (
        param.ndim in (2, 3)
        and "layers" in parts
        and not any(part in ("gate", "router", "embed_tokens", "lm_head") for part in parts)
    )


def muon_param_groups(
    model: nn.Module, muon_params: Callable[[str, Tensor], bool] = default_muon_rule
) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as :class:`Muon`'s parameter groups: those ``muon_params(name, param)``
    picks with ``use_muon=True``, the others with ``use_muon=False`` (an empty group is left out). Add options to
    either dict (``lr``, ``weight_decay``, ...) to set them for that group only."""
    chosen: list[Tensor] = []
    others: list[Tensor] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (chosen if muon_params(name, param) else others).append(param)
    groups = [{"params": chosen, "use_muon": True}, {"params": others, "use_muon": False}]
    return [group for group in groups if group["params"]]


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups with ``use_muon=True`` (the default), AdamW for those with ``False``.

    Build it from :func:`muon_param_groups` (``Muon(muon_param_groups(model), lr=1e-3)``) or from groups of
    your own. A Muon group takes only 2-D matrices and 3-D expert stacks. Options, each settable per group:

    - ``lr``, ``weight_decay``: both kinds (decoupled decay ``p <- p (1 - lr wd)``; with the default
      ``lr_scaling="match_rms_adamw"`` one value suits both, per Moonshot's paper);
    - ``momentum`` (0.95), ``nesterov`` (True), ``lr_scaling`` (:data:`LrScaling`), ``ns_steps`` (5),
      ``ns_coefficients``, ``ns_dtype`` (``"bfloat16"``/``"float32"``; default: bf16 on CUDA, fp32 elsewhere):
      Muon's, as ``torch.optim.Muon`` has them (its momentum is the same: ``buf <- lerp(buf, g, 1 - momentum)``,
      Nesterov's update ``lerp(g, buf, momentum)``);
    - ``betas``, ``eps``: AdamW's (``torch.optim.AdamW``'s update and defaults).

    With DTensor parameters each Muon matrix is gathered once per step (module docstring). Refused: sparse
    gradients, complex parameters, and parameters of other dims in a Muon group.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        lr_scaling: LrScaling = "match_rms_adamw",
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: str | torch.dtype | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"Muon needs lr >= 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, {momentum}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "use_muon": True,
            "momentum": momentum,
            "nesterov": nesterov,
            "lr_scaling": lr_scaling,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            # a name, not a torch.dtype: param_groups travel in checkpoints as plain values
            "ns_dtype": _dtype_name(ns_dtype),
            "betas": tuple(betas),
            "eps": eps,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            group["ns_dtype"] = _dtype_name(group["ns_dtype"])
            lr_scale((1, 1), group["lr_scaling"])  # refuses an unknown rule now
            for param in group["params"]:
                if torch.is_complex(param):
                    raise ValueError(f"Muon does not support complex parameters, got {tuple(param.shape)}")
                if group["use_muon"] and param.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalises matrices (2-D) and expert stacks (3-D), got a parameter of shape "
                        f"{tuple(param.shape)} in a use_muon group: put it in a group with use_muon=False "
                        "(muon_param_groups(model) does so for norms, biases, embeddings and the head)"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                if group["use_muon"]:
                    self._muon_step(param, group)
                else:
                    self._adamw_step(param, group)
        return loss

    def _muon_step(self, param: Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        grad, buffer, momentum = param.grad, state["momentum_buffer"], group["momentum"]
        assert grad is not None
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        dtype = getattr(torch, group["ns_dtype"]) if group["ns_dtype"] else None
        orthogonal = _orthogonalise(update, param, group["ns_steps"], tuple(group["ns_coefficients"]), dtype)
        lr = float(group["lr"])
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonal, alpha=-lr * lr_scale(param.shape, group["lr_scaling"]))

    def _adamw_step(self, param: Tensor, group: dict[str, Any]) -> None:
        """torch's single-tensor AdamW update, operation for operation (so it matches ``torch.optim.AdamW``
        with ``foreach=False``)."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        grad = param.grad
        assert grad is not None
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = float(state["step"].item())
        param.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def _orthogonalise(
    update: Tensor,
    param: Tensor,
    steps: int,
    coefficients: tuple[float, float, float],
    dtype: torch.dtype | None,
) -> Tensor:
    """:func:`newton_schulz` of ``update`` laid out as ``param`` is: a DTensor is gathered whole, orthogonalised
    on every rank alike and sliced back to ``param``'s placements; an expert stack sharded only over its experts
    (dim 0) is orthogonalised where it lies, expert by expert."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, coefficients, dtype)
    assert isinstance(param, DTensor)
    mesh = param.device_mesh
    if update.ndim == 3 and update.placements == param.placements and _whole_experts(param):
        local = newton_schulz(update.to_local(), steps, coefficients, dtype)
        return DTensor.from_local(local, mesh, param.placements, shape=param.shape, stride=param.stride())
    whole = newton_schulz(update.full_tensor(), steps, coefficients, dtype)
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements)


def _whole_experts(param: DTensor) -> bool:
    return all(not isinstance(p, Shard) or p.dim == 0 for p in param.placements)


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ValueError(f"ns_dtype must be a floating dtype (e.g. 'bfloat16', 'float32'), got {dtype!r}")
    return name
