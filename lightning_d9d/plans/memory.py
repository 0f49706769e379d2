"""How much device memory one rank needs: parameters, gradients, optimizer state and activations.

Pure functions (no process group, no device): the strategy prints the plan on rank 0 at the first training
step (``strategies/memory_report.py``), when the shapes and the loss are known, so that a user sees before the
first backward whether a mesh fits. Parameters, gradients and optimizer state are counted from the parameters as
parallelized (a DTensor's global size divided over the mesh dims it is sharded on); activations are an estimate
from the model config (a decoder-only transformer: hidden size, heads, MLP or MoE sizes, vocabulary) and the
tokens one rank holds at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_d9d.compat import strided_shard_type
from lightning_d9d.kernels.linear_cross_entropy import default_chunk_tokens

GIB = 1024**3

# Optimizer state tensors of the parameter's size, per parameter (the step counters are scalars).
_STATES_PER_PARAMETER = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adagrad": 1,
    "Adadelta": 2,
    # bf16 parameters; an fp32 master and two fp32 moments each: 12 bytes, six of the parameter's size
    "MasterWeightAdamW": 6,
}


StatesPerParameter = int | Callable[[torch.Tensor], int]
"""Optimizer state tensors of a parameter's size: one count for every parameter, or a count parameter by parameter
(an optimizer whose groups keep different state)."""


def optimizer_states_per_parameter(optimizer: torch.optim.Optimizer) -> StatesPerParameter | None:
    """Tensors of a parameter's size the optimizer keeps per parameter; None for one this table does not know."""
    name = type(optimizer).__name__
    if (
        name == "Muon"
    ):  # a momentum buffer for a matrix of a use_muon group, AdamW's two moments for the others
        return _states_by_group(optimizer, lambda group: 1 if group["use_muon"] else 2)
    if name == "StochasticAdamW":  # bf16 parameters; its state depends on its options
        return int(optimizer.states_per_parameter)  # type: ignore[attr-defined]
    if name == "SGD":
        return int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    if name == "RMSprop":
        group = optimizer.param_groups[0]
        return 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered", False)))
    if name in _STATES_PER_PARAMETER:
        amsgrad = any(group.get("amsgrad", False) for group in optimizer.param_groups)
        return _STATES_PER_PARAMETER[name] + int(amsgrad)
    return None


def _states_by_group(
    optimizer: torch.optim.Optimizer, states: Callable[[dict[str, Any]], int]
) -> Callable[[torch.Tensor], int]:
    """``states(group)`` for each parameter of ``optimizer``'s groups; 0 for a parameter it does not hold."""
    by_parameter = {id(p): states(group) for group in optimizer.param_groups for p in group["params"]}
    return lambda parameter: by_parameter.get(id(parameter), 0)


def local_numel(parameter: torch.Tensor) -> float:
    """This rank's share of a parameter: its global size over the mesh dims it is sharded on (DTensor), else all.
    A strided shard counts as a shard (the fused gate/up weight of experts split over tp: ``plans/expert_tensor.py``;
    torch's ``_StridedShard`` is no ``Shard``)."""
    if isinstance(parameter, DTensor):
        ways = math.prod(
            parameter.device_mesh.size(dim)
            for dim, placement in enumerate(parameter.placements)
            if isinstance(placement, (Shard, strided_shard_type()))
        )
        return parameter.numel() / ways
    return float(parameter.numel())


@dataclass(frozen=True)
class ActivationShape:
    """What one rank computes on at a time: ``tokens`` per microbatch (after the cp split), the transformer
    ``layers`` it holds, how many microbatches are alive at once (``in_flight``: 1 without pipelines), the
    activation element size, the tp degree (sequence parallel splits everything a block saves), whether it
    holds the LM head (``head``) and recomputes blocks in backward (``recompute``), whether the head's loss
    is fused with it (``head_fused``: the chunked LM head + cross-entropy, which keeps no ``[tokens, vocab]``
    logits), and whether the MoE experts are split over tp (``expert_tensor_parallel``: each tp rank then runs
    the tp group's routed rows, ``tp`` times its own, through its ``1/tp`` of the experts' width)."""

    tokens: int
    layers: int
    in_flight: int = 1
    dtype_bytes: int = 2
    tp: int = 1
    head: bool = True
    recompute: bool = False
    head_fused: bool = False
    expert_tensor_parallel: bool = False


def _config_value(config: Any, *names: str, default: int | None = None) -> int | None:
    source: Mapping[str, Any] = config if isinstance(config, Mapping) else vars(config)
    for name in names:
        if source.get(name) is not None:
            return int(source[name])
    return default


def block_elements_per_token(config: Any, *, expert_rows: int = 1) -> int | None:
    """Elements a decoder block saves for backward per token, counted for our blocks: the two norms' inputs
    and outputs (4 hidden widths); q before its norm, after RoPE (kept by the attention kernel), the attention
    output and its copy into o_proj (4 q widths); k before its norm and after RoPE, and v (3 kv widths); per
    MLP the gate, the up projection and their activated product (3 intermediate widths); an MoE layer keeps
    that for each of its top-k experts with their inputs and outputs, plus the router logits. Assumes an
    attention kernel that keeps no ``[tokens, tokens]`` scores (flash / memory-efficient SDPA). None when
    ``config`` lacks the sizes. ``expert_rows``: how many tokens' expert rows (their ``hidden``-wide inputs and
    outputs) a rank keeps per token of its own: ``tp`` when the experts are split over tp (the tp group's rows are
    gathered; their ``ffn``-wide parts are ``1/tp`` as wide, the same elements), else 1."""
    hidden = _config_value(config, "hidden_size")
    heads = _config_value(config, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    head_dim = _config_value(config, "head_dim", default=hidden // heads) or hidden // heads
    kv_heads = _config_value(config, "num_key_value_heads", default=heads) or heads
    experts = _config_value(config, "num_experts", default=0) or 0
    if experts > 0:
        top_k = _config_value(config, "num_experts_per_tok", default=1) or 1
        width = _config_value(config, "moe_intermediate_size", "intermediate_size")
        if width is None:
            return None
        # expert inputs/outputs per choice, router logits
        mlp = top_k * (3 * width + 2 * hidden * expert_rows) + experts
    else:
        width = _config_value(config, "intermediate_size")
        if width is None:
            return None
        mlp = 3 * width
    return 4 * hidden + 4 * heads * head_dim + 3 * kv_heads * head_dim + mlp


def activation_bytes(config: Any, shape: ActivationShape) -> int | None:
    """Bytes of activations alive at the peak (the start of backward) on one rank; None if unknown.

    Without recompute every held layer keeps :func:`block_elements_per_token` per token; with recompute a layer
    keeps only its input (h) and one layer at a time is recomputed in full. The head, on the rank that holds it,
    adds :func:`head_bytes` for one microbatch.
    """
    block = block_elements_per_token(config, expert_rows=shape.tp if shape.expert_tensor_parallel else 1)
    hidden = _config_value(config, "hidden_size")
    vocab = _config_value(config, "vocab_size", default=0) or 0
    if block is None or hidden is None:
        return None
    tokens = shape.tokens * shape.in_flight
    # with recompute: each layer's input, and one layer recomputed in full (for one microbatch)
    per_token = shape.layers * hidden + block / shape.in_flight if shape.recompute else shape.layers * block
    total = tokens * per_token * shape.dtype_bytes / shape.tp
    if shape.head:
        total += head_bytes(shape, hidden, vocab)
    return int(total)


def head_bytes(shape: ActivationShape, hidden: int, vocab: int) -> float:
    """Bytes the LM head and its loss add at the step's peak, for ``shape.tokens`` tokens (T), ``hidden`` (H),
    ``vocab`` (V) and the compute dtype's ``b = shape.dtype_bytes`` (the head's weight and hidden states run in
    it: the parameters' dtype, or autocast's / FSDP's bf16).

    The logits path (``head_fused=False``) peaks in the cross-entropy's backward: the float32 log-softmax it
    saved, the gradient arriving for it and the gradient it computes, all ``[T, V]`` float32:
    ``12 T V / tp`` (vocabulary-parallel under tp).

    The fused head (``lightning_d9d/kernels/linear_cross_entropy.py``, never under tp) computes both gradients
    in its forward and saves them: ``grad_hidden`` ``[T, H]`` in b bytes and ``grad_weight`` ``[V, H]`` in
    float32, alive from the head's forward to its backward. On top of them, at different moments: during the
    forward one chunk of ``C = default_chunk_tokens(V, T)`` tokens, ``c`` bytes per logit: its logits (b) and,
    below float32, their float32 upcast and the gradient's copy back in b (``c = 2 b + 4``; in float32 both are
    the logits themselves, changed in place: ``c = 4``). That is the torch path; the Triton kernel on CUDA
    keeps only the b-byte logits, so there this is an upper bound (by ``C V (b + 4)``: 1.7 GiB at Qwen3's
    vocabulary in bf16). In the backward: the scaled copies ``grad_hidden * g`` ``[T, H]`` and ``grad_weight``
    in the weight's dtype ``[V, H]``, both b. So::

        4 V H + b T H + max(c C V, b V H + b T H)
    """
    if not shape.head_fused:
        return shape.tokens * vocab * 12 / shape.tp
    b = shape.dtype_bytes
    saved = 4 * vocab * hidden + b * shape.tokens * hidden
    per_logit = b if b >= 4 else 2 * b + 4
    chunk = default_chunk_tokens(vocab, shape.tokens) * vocab * per_logit
    backward_copies = b * (vocab * hidden + shape.tokens * hidden)
    return float(saved + max(chunk, backward_copies))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank; ``activations`` / ``optimizer`` are None when they cannot be estimated."""

    parameters: int
    gradients: int
    optimizer: int | None
    activations: int | None
    device_memory: int | None = None  # what the device has, when known
    frozen: int = 0  # of ``parameters``, the bytes that do not train (no gradient, no optimizer state)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0) + (self.activations or 0)

    @property
    def exceeds_device(self) -> bool:
        return self.device_memory is not None and self.total > self.device_memory

    def describe(self, heading: str) -> str:
        def gib(value: int | None) -> str:
            if value is None:
                return "unknown"
            return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / 2**20:.2f} MiB"

        device = "" if self.device_memory is None else f" of {gib(self.device_memory)} on the device"
        return "\n".join(
            [
                heading,
                f"  parameters   {gib(self.parameters)}"
                + (
                    f" ({gib(self.parameters - self.frozen)} trained, {gib(self.frozen)} frozen)"
                    if self.frozen
                    else ""
                ),
                f"  gradients    {gib(self.gradients)}",
                f"  optimizer    {gib(self.optimizer)}",
                f"  activations  {gib(self.activations)} (estimate)",
                f"  total        {gib(self.total)}{device}",
            ]
        )


def plan_memory(
    parameters: Iterable[torch.Tensor],
    *,
    optimizer_states: StatesPerParameter | None,
    config: Any | None,
    activations: ActivationShape | None,
    device_memory: int | None = None,
) -> MemoryPlan:
    """The memory plan of one rank from its (parallelized) parameters, the optimizer's states per parameter, the
    model config and the activation shape. Gradients and optimizer states take the parameters' dtype (under
    ``bf16-mixed`` the parameters are float32 master weights; FSDP computes in bf16 from gathered copies)."""
    held = list(parameters)
    parameter_bytes = sum(local_numel(p) * p.element_size() for p in held)
    # frozen parameters have no gradient and no optimizer state
    trainable_bytes = sum(local_numel(p) * p.element_size() for p in held if p.requires_grad)
    optimizer = None
    if isinstance(optimizer_states, int):
        optimizer = int(trainable_bytes * optimizer_states)
    elif optimizer_states is not None:
        optimizer = int(
            sum(local_numel(p) * p.element_size() * optimizer_states(p) for p in held if p.requires_grad)
        )
    activation = None
    if config is not None and activations is not None:
        activation = activation_bytes(config, activations)
    return MemoryPlan(
        parameters=int(parameter_bytes),
        gradients=int(trainable_bytes),
        optimizer=optimizer,
        activations=activation,
        device_memory=device_memory,
        frozen=int(parameter_bytes - trainable_bytes),
    )
