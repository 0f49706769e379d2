"""Attention with sinks (GPT-OSS) under tensor parallelism: its heads split over tp, each head's sink with it.

GPT-OSS's attention holds ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``sinks [num_heads]``, one softmax
logit per head that no value goes with. ``transformers`` 5.x ships its tp plan with the embedding alone
(``{"embed_tokens": "embedding_rowwise"}``), so nothing of the attention would be split and the decoder layer could
not be sequence-sharded around its MoE block. :func:`sink_attention_plan` supplies the split a head-parallel
attention takes (q/k/v column-parallel, o row-parallel: its bias added once, after the reduction) for the
projections the config's plan leaves out, and :class:`HeadShardedSinks` shards ``sinks`` with the heads:

- the Parameter becomes a ``Shard(0)`` ``DTensor`` over tp (checkpoints and FSDP know its layout);
- during the module's forward its ``sinks`` attribute is this rank's shard (``to_local()``, the gradient
  flowing back into the ``DTensor``), so the class's own attention, ``transformers``' eager function (which reads
  ``module.sinks``) and the context-parallel one (handed ``s_aux=self.sinks``) see this rank's heads' sinks beside
  this rank's heads. Outside the forward the attribute is the Parameter again, under its own name
  (``self_attn.sinks``), as FSDP and checkpoints read it.

Nothing here imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

SINKS = "sinks"
# The projections of a head-parallel attention and the style each takes.
PROJECTIONS = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}


def sink_attentions(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules of ``model`` with sinks (by module name): a 1-D ``sinks`` Parameter of their own
    beside ``nn.Linear`` q/k/v/o projections."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        sinks = module._parameters.get(SINKS)
        linears = all(isinstance(getattr(module, p, None), nn.Linear) for p in PROJECTIONS)
        if sinks is not None and sinks.ndim == 1 and linears:
            found[name] = module
    return found


def sink_attention_plan(model: nn.Module, planned: dict[str, str]) -> dict[str, str]:
    """The tp plan entries (module name -> style) of every sink attention's projections that ``planned`` (the
    config's plan, expanded) does not name."""
    supplied: dict[str, str] = {}
    for name in sink_attentions(model):
        for projection, style in PROJECTIONS.items():
            supplied.setdefault(f"{name}.{projection}", style)
    return {name: style for name, style in supplied.items() if name not in planned}


class HeadShardedSinks(ParallelStyle):
    """``sinks`` sharded with the heads (``Shard(0)`` over tp) and read as this rank's shard during the module's
    forward (see the module docstring); then ``then``, the module's own style in the plan (the region's sequence
    gather), if any."""

    def __init__(self, then: ParallelStyle | None = None) -> None:
        super().__init__()
        self.then = then

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module._parameters.get(SINKS)
        if sinks is None or sinks.ndim != 1:
            raise TypeError(f"{type(module).__name__} holds no per-head sinks to shard")
        sharded = distribute_tensor(sinks.detach(), device_mesh, [Shard(0)])
        module._parameters[SINKS] = nn.Parameter(sharded, requires_grad=sinks.requires_grad)
        module.register_forward_pre_hook(_expose_local_sinks)
        module.register_forward_hook(_hide_local_sinks, always_call=True)
        return module if self.then is None else self.then._apply(module, device_mesh)


def _expose_local_sinks(module: nn.Module, args: Any) -> None:
    """For the forward: ``module.sinks`` is this rank's shard. An instance attribute is found before
    ``nn.Module.__getattr__`` looks in ``_parameters``; FSDP, ``named_parameters`` and the state dict read
    ``_parameters`` and still see the ``DTensor`` Parameter."""
    sinks = module._parameters[SINKS]
    module.__dict__[SINKS] = sinks.to_local() if isinstance(sinks, DTensor) else sinks


def _hide_local_sinks(module: nn.Module, args: Any, output: Any) -> None:
    module.__dict__.pop(SINKS, None)
