"""Activation checkpointing of repeated blocks (recompute activations in backward to save memory).

Two kinds: ``"full"`` keeps only each block's input and recomputes the whole block in backward; ``"selective"``
(op-level) also keeps the outputs of the matmuls and of attention, so backward recomputes only the cheap
element-wise ops (norms, activations, RoPE, residual adds). Selective recompute costs a few percent of step
time instead of a whole extra forward of the blocks, and keeps more memory than full.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_d9d.compat import checkpoint_wrapper, ignore_in_selective_replay, profiler_range_ops

CheckpointingKind = Literal["full", "selective"]
#: What ``activation_checkpointing`` accepts (strategy and ParallelOptions): off, full, or selective.
CHECKPOINTING_CHOICES: tuple[bool | str, ...] = (False, True, "full", "selective")

_aten = torch.ops.aten
# Outputs that selective checkpointing keeps: the matmuls and attention, the ops whose recompute costs FLOPs.
SAVED_BY_SELECTIVE = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._grouped_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def checkpointing_kind(value: bool | str) -> CheckpointingKind | None:
    """``False`` -> None, ``True`` / ``"full"`` -> ``"full"``, ``"selective"``; anything else is refused."""
    if value is False:
        return None
    if value is True or value == "full":
        return "full"
    if value == "selective":
        return "selective"
    raise ValueError(
        f"activation_checkpointing={value!r}: choose False, True (or 'full': recompute whole blocks) or "
        "'selective' (keep matmul and attention outputs, recompute the element-wise ops)"
    )


def check_checkpointing_layout(value: bool | str, *, pp: int, ep: int) -> None:
    """Refuse selective recompute of pipeline stages whose experts are FSDP units of their own (``pp > 1``
    with ``ep > 1``), before any process group exists. There the experts' parameters are gathered in the
    recompute where the forward found them already gathered (or the reverse, as the schedule interleaves
    micro-batches), and the replay, which matches a block's ops by call count, fails in the first backward
    ("aten._to_copy.default invocation index 12 encountered during backward but not found in storage"; eager
    and compiled, torch 2.13). Torch's fix is to run FSDP's gathers outside that count (pytorch PR 196862)."""
    if checkpointing_kind(value) == "selective" and pp > 1 and ep > 1:
        raise ValueError(
            f"activation_checkpointing='selective' with pp={pp} and ep={ep}: torch's selective recompute "
            "cannot replay pipeline stages whose experts are FSDP units of their own; use "
            "activation_checkpointing=True (full recompute of each block), or selective with pp=1 or ep=1"
        )


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def replay_ignores_profiler_ranges() -> None:
    """Have selective checkpointing run profiler range markers without counting them (process-wide, idempotent).
    The markers compute nothing, yet selective checkpointing counts them like model ops. Both torch names are
    looked up here, when a selective policy is built (:mod:`lightning_d9d.compat` lists them), not at import.

    Selective checkpointing replays a block's ops by (op, call index) and fails when the recompute calls an op
    more often than the forward did. A block that holds an FSDP unit of its own (an MoE block's experts under
    ep) runs that unit's hooks inside the region, and their ``record_function`` ranges differ between forward
    and recompute: "profiler._record_function_enter_new.default invocation index 3 encountered during backward
    but not found in storage", eager or compiled (pytorch/torchtitan#3427; the torch fix, pytorch/pytorch#185178
    / #196862, is not in torch 2.13). Torch's own ignore list is where that fix puts these ops too.
    """
    ignore_in_selective_replay(profiler_range_ops())


def apply_activation_checkpointing(
    blocks: nn.ModuleList | nn.ModuleDict,
    *,
    preserve_rng_state: bool = True,
    kind: CheckpointingKind = "full",
) -> None:
    """Wrap every block of ``blocks`` in place. Parameter names gain a ``_checkpoint_wrapped_module``
    segment inside the wrapper; ``torch.distributed.checkpoint`` state dicts strip it again.

    ``preserve_rng_state`` restores the RNG state before each recompute, so dropout draws the same masks as in
    forward. Turn it off (it costs a state save and restore per block) only for blocks without random ops.
    ``kind`` is ``"full"`` or ``"selective"`` (see the module's docstring).
    """
    if kind not in ("full", "selective"):
        raise ValueError(f"apply_activation_checkpointing: kind={kind!r}; choose 'full' or 'selective'")
    extra: dict[str, Any] = {}
    if kind == "selective":
        replay_ignores_profiler_ranges()
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=preserve_rng_state, **extra)  # type: ignore[index]
