"""Top-k token-choice router: which experts each token goes to, and with what weight.

Matches transformers' ``Qwen3MoeTopKRouter`` exactly when ``selection_bias`` is off: ``logits = x @ weight.T``
in the input's dtype, softmax in fp32, top-k of the probabilities, optionally renormalised to sum to one
(``norm_topk_prob``), weights cast back to the logits' dtype. The parameter is ``weight [E, H]`` as there.

``selection_bias`` adds the auxiliary-loss-free balancing of DeepSeek-V3: a per-expert bias (a buffer, not a
parameter) added to the probabilities only to *choose* the experts; the weights stay the unbiased
probabilities. :func:`lightning_d9d.modules.moe.balancing.update_expert_bias` moves it after each optimizer
step from the load counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_d9d.compat import in_backward_pass
from lightning_d9d.kernels import count_tokens_per_expert


@torch.library.custom_op("lightning_d9d::count_expert_load", mutates_args=("load",))
def count_expert_load(load: torch.Tensor, tokens_per_expert: torch.Tensor, count: bool) -> None:
    """``load += tokens_per_expert`` when ``count``, except while a backward pass runs: there a forward is
    activation checkpointing's recompute of one already counted (the loads came out twice as large with it,
    full or selective, eager or compiled). An operator of its own so that compiled blocks keep the check for run
    time instead of tracing it away; the backward pass is told by its graph task, as ``torch.utils.checkpoint``
    tells it (:func:`lightning_d9d.compat.in_backward_pass`). Called whether or not ``count``:
    selective checkpointing replays a block's ops by call count, so a forward with counting paused (torch's
    pipeline metadata inference) must call the same ops as any recompute of it, which would run after the
    pause."""
    if count and not in_backward_pass():
        load.add_(tokens_per_expert)


@count_expert_load.register_fake
def _(load: torch.Tensor, tokens_per_expert: torch.Tensor, count: bool) -> None:
    return None


@dataclass(frozen=True)
class Routing:
    """One router call over ``T`` tokens: ``expert_indices [T, k]`` (int64), ``expert_weights [T, k]`` (the
    logits' dtype), ``tokens_per_expert [E]`` (int64, slots per expert), and for the losses ``logits [T, E]``
    and ``probs [T, E]`` (fp32, unbiased)."""

    expert_indices: torch.Tensor
    expert_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor

    @property
    def top_k(self) -> int:
        return int(self.expert_indices.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.probs.shape[1])


class TopKRouter(nn.Module):
    """``[T, H]`` tokens -> :class:`Routing`.

    Buffers: ``expert_load [E]`` (int64, not saved) counts the slots each expert received in training-mode
    forwards since the last :func:`~lightning_d9d.modules.moe.balancing.update_expert_bias`, i.e. over every
    micro-step of an accumulation window; activation checkpointing's recompute of a forward is not counted
    again (:func:`count_expert_load`). With ``selection_bias``: ``expert_bias [E]`` (fp32, saved in
    checkpoints: it is training state)."""

    expert_load: torch.Tensor
    expert_bias: torch.Tensor | None
    # Off while a forward is not training (torch's pipeline metadata inference: see balancing.paused_load_counting)
    count_load: bool = True

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool = False,
        selection_bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device))
        self.register_buffer(
            "expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
        )
        if selection_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default

    def forward(self, hidden: torch.Tensor) -> Routing:
        hidden = hidden.reshape(-1, self.hidden_size)
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is None:
            weights, indices = torch.topk(probs, self.top_k, dim=-1)
        else:
            # The bias only chooses; the weights are the unbiased probabilities of the chosen experts.
            indices = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            weights = probs.gather(1, indices)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        tokens_per_expert = count_tokens_per_expert(indices, self.num_experts)
        if self.training:
            count_expert_load(self.expert_load, tokens_per_expert, self.count_load)
        return Routing(
            expert_indices=indices,
            expert_weights=weights.to(logits.dtype),
            tokens_per_expert=tokens_per_expert,
            logits=logits,
            probs=probs,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"normalize_top_k={self.normalize_top_k}, selection_bias={self.expert_bias is not None}"
        )
