"""A ``transformers`` MoE model's routers, counting their experts' load and, where asked, choosing with the
auxiliary-loss-free selection bias (DeepSeek-V3), as our own :class:`~lightning_d9d.modules.moe.TopKRouter` does.

``transformers``' token-choice routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ...) hold ``weight [E, H]``,
``top_k`` and ``num_experts`` and return ``(router_logits, top-k weights, top-k indices)``; the MoE block hands
the last two to its experts module. Each router here keeps its class's own forward and gets a wrapper around it:

- :func:`count_router_load` (the adapter's plan calls it on every MoE model): the wrapper adds the indices'
  per-expert counts to an ``expert_load [E]`` buffer (int64, not saved) in training forwards, through the same
  operator as our router (:func:`~lightning_d9d.modules.moe.router.count_expert_load`: a recompute is not
  counted twice, nor a forward while counting is paused). The outputs are the class's own, bit for bit.
  :class:`~lightning_d9d.callbacks.ExpertLoadBalancing` finds such routers
  (:class:`~lightning_d9d.modules.moe.LoadCountingRouter`) and logs their load per layer.
- :func:`add_selection_bias` (the user calls it, on ``meta`` or not, before the strategy sets up, e.g. in
  ``configure_model``): the router also gets ``expert_bias [E]`` (fp32 zeros, a persistent buffer: training
  state, saved in the training checkpoint), and the wrapper chooses the experts by ``softmax(logits) + bias``
  while the weights stay what the class computes from the chosen experts' unbiased logits (their probabilities,
  renormalised where the class renormalises, or GPT-OSS's softmax over the chosen logits);
  ``ExpertLoadBalancing`` moves the bias after each optimizer step. The logits are the class's own, so an
  auxiliary load-balancing loss the model computes from them is unchanged.

Which weights a class returns (:data:`WEIGHTINGS`: the chosen probabilities, renormalised or not, or a softmax
over the chosen logits, as GPT-OSS's router with its logit bias computes them; in which dtype) is read off the class
itself: its forward
runs on a CPU copy of the router for fp32 and bf16 inputs, and the biased wrapper, with the bias at zero, must
give the same indices and weights exactly, or the class is refused with its name (:func:`add_selection_bias`) or
left to count only. A router whose forward does not return that triple is left alone.

The Hugging Face format knows nothing of the bias: ``ExportHF`` writes the model's own tensors
(``transformers``' classes have no field for it, ``from_pretrained`` would drop it), ``LoadHFWeights`` leaves it
as it is.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_d9d.kernels import count_tokens_per_expert
from lightning_d9d.models.hf.config_plans import expert_modules, moe_blocks
from lightning_d9d.modules.moe.router import count_expert_load

log = logging.getLogger("lightning_d9d.models.hf")
# How a router class weighs the experts it chose: their softmax probabilities (Qwen3-MoE), those renormalised over
# the top k (Mixtral; Qwen3-MoE with norm_topk_prob), or a softmax over the chosen experts' logits, in the logits'
# dtype (GPT-OSS: the renormalised probabilities' value, rounded otherwise).
PROBABILITIES, RENORMALISED, CHOSEN_LOGITS = "probabilities", "renormalised", "softmax_of_chosen_logits"
WEIGHTINGS = (PROBABILITIES, RENORMALISED, CHOSEN_LOGITS)
# The instance attribute that marks a wrapped router: its class's weighting (one of WEIGHTINGS).
_WEIGHTING = "_d9d_weighting"
_PROBED: dict[tuple[type, tuple[tuple[str, Any], ...]], str | None] = {}


def hf_routers(model: nn.Module) -> dict[str, nn.Module]:
    """The routers of ``model``'s MoE blocks (by module name): the block's child holding ``weight [E, H]``,
    ``top_k`` and ``num_experts``, beside the experts module."""
    experts = {id(module) for module in expert_modules(model).values()}
    found: dict[str, nn.Module] = {}
    for block_name, block in moe_blocks(model).items():
        for child_name, child in block.named_children():
            if id(child) not in experts and _looks_like_router(child):
                found[f"{block_name}.{child_name}"] = child
    return found


def count_router_load(model: nn.Module) -> list[str]:
    """Give every router of ``model`` the counting wrapper (see the module docstring), in place; routers already
    wrapped keep theirs. Returns the names of the routers that count."""
    counting = []
    for name, router in hf_routers(model).items():
        if _wrap(router, selection_bias=False, refuse=False):
            counting.append(name)
    return counting


def add_selection_bias(model: nn.Module) -> list[str]:
    """Give every router of ``model``'s MoE blocks an ``expert_bias`` (zeros) that chooses its experts, moved by
    :class:`~lightning_d9d.callbacks.ExpertLoadBalancing` (see the module docstring). Call it before the
    strategy sets up (in ``configure_model``, on ``meta`` too). Returns the routers' names; refuses a model
    without MoE routers, and a router class whose weights the wrapper cannot reproduce."""
    routers = hf_routers(model)
    if not routers:
        raise ValueError(
            f"{type(model).__name__}: add_selection_bias found no MoE router (a block beside an experts module "
            "of the config's base_model_ep_plan, holding weight [E, H], top_k and num_experts)"
        )
    for router in routers.values():
        _wrap(router, selection_bias=True, refuse=True)
    return list(routers)


def _looks_like_router(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
    return (
        isinstance(weight, nn.Parameter)
        and weight.ndim == 2
        and isinstance(experts, int)
        and isinstance(top_k, int)
        and weight.shape[0] == experts
    )


def _wrap(router: Any, *, selection_bias: bool, refuse: bool) -> bool:
    """Install the wrapper (and the bias when ``selection_bias``); False where the class is not ours to wrap."""
    if getattr(router, _WEIGHTING, None) is None:  # not wrapped yet: read the class off a probe first
        weighting = _weighting_of(router)
        if weighting is None:
            if refuse:
                raise NotImplementedError(
                    f"{type(router).__name__}: its forward does not return (logits, top-k weights, top-k "
                    "indices) that a softmax over the logits, its top k and their probabilities (optionally "
                    "renormalised) or a softmax over their logits reproduce exactly, so the selection bias cannot choose for it; train without "
                    "add_selection_bias (the auxiliary loss of the model's config balances it)"
                )
            log.info("%s: not a softmax top-k router; its load is not counted", type(router).__name__)
            return False
        device = router.get_parameter("weight").device
        router.register_buffer(
            "expert_load", torch.zeros(router.num_experts, dtype=torch.int64, device=device), persistent=False
        )
        router.register_buffer("expert_bias", None)
        router.count_load = True
        setattr(router, _WEIGHTING, weighting)
        router.forward = types.MethodType(_counting_forward, router)  # type: ignore[method-assign]
        _zero_counters_at_init(router)
    if selection_bias and router.expert_bias is None:
        device = router.get_parameter("weight").device
        router.register_buffer(
            "expert_bias", torch.zeros(router.num_experts, dtype=torch.float32, device=device)
        )
    return True


def _weighting_of(router: Any) -> str | None:
    """:func:`_probe_weighting`, once per class and settings: a class may renormalise by a setting of the
    instance (Qwen3-MoE's ``norm_topk_prob``), so the key holds the instance's plain attributes."""
    settings = tuple(
        sorted(
            (k, v)
            for k, v in vars(router).items()
            if not k.startswith("_") and isinstance(v, int | float | str)
        )
    )
    key = (type(router), settings)
    if key not in _PROBED:
        _PROBED[key] = _probe_weighting(router)
    return _PROBED[key]


def _counting_forward(
    self: Any, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, weights, indices = type(self).forward(self, hidden_states)
    if self.expert_bias is not None:
        weights, indices = _biased_choice(
            logits, self.expert_bias, self.top_k, getattr(self, _WEIGHTING), weights.dtype
        )
    if self.training:
        count_expert_load(
            self.expert_load, count_tokens_per_expert(indices, self.num_experts), self.count_load
        )
    return logits, weights, indices


def _biased_choice(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, weighting: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts chosen by ``softmax(logits) + bias``; their weights by the class's ``weighting`` (one of
    :data:`WEIGHTINGS`) from the unbiased logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    indices = torch.topk(probs + bias, top_k, dim=-1).indices
    if weighting == CHOSEN_LOGITS:
        chosen = logits.gather(1, indices)
        return torch.softmax(chosen, dim=1, dtype=chosen.dtype).to(dtype), indices
    weights = probs.gather(1, indices)
    if weighting == RENORMALISED:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), indices


def _probe_weighting(router: Any) -> str | None:
    """How the class weighs its top-k experts (:data:`WEIGHTINGS`, read off its forward on a CPU copy of
    ``router`` with random parameters: its weight and any logit bias), or ``None`` where no weighting reproduces
    its outputs exactly."""
    probe: Any = copy.deepcopy(router)
    probe.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    candidates = list(WEIGHTINGS)
    for dtype in (torch.float32, torch.bfloat16):
        probe.to(dtype)
        with torch.no_grad():
            for param in probe.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
            hidden = torch.randn(7, probe.get_parameter("weight").shape[1], generator=generator).to(dtype)
            try:
                outputs = type(router).forward(probe, hidden)
            except Exception:  # a forward reading what a plain copy lacks: not ours to wrap
                return None
            if not _is_routing_triple(outputs, probe.num_experts):
                return None
            logits, weights, indices = outputs
            zero = torch.zeros(probe.num_experts)
            candidates = [
                choice
                for choice in candidates
                if _equal(
                    _biased_choice(logits, zero, probe.top_k, choice, weights.dtype), (weights, indices)
                )
            ]
    return candidates[0] if candidates else None


def _is_routing_triple(outputs: Any, num_experts: int) -> bool:
    if (
        not isinstance(outputs, tuple)
        or len(outputs) != 3
        or not all(isinstance(t, torch.Tensor) for t in outputs)
    ):
        return False
    logits, weights, indices = outputs
    return logits.shape[-1] == num_experts and indices.dtype == torch.int64 and weights.shape == indices.shape


def _equal(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _zero_counters_at_init(router: Any) -> None:
    """A model built on ``meta`` is initialised by ``transformers``' rules, which know nothing of our buffers: the
    router's own ``reset_parameters`` (which the initialisation calls before the rules when a tensor is left
    unwritten: :mod:`lightning_d9d.modules.hf_init`) zeroes them, after the class's own where it has one."""
    own: Callable[[], None] | None = getattr(router, "reset_parameters", None)

    def reset_parameters() -> None:
        if own is not None:
            own()
        router.expert_load.zero_()
        if router.expert_bias is not None:
            router.expert_bias.zero_()

    router.reset_parameters = reset_parameters
