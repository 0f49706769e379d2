"""Attention with sinks (GPT-OSS) under tensor parallelism: its heads split over tp, each head's sink with it.

GPT-OSS's attention holds ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``sinks [num_heads]``, one softmax
logit per head that no value goes with. ``transformers`` 5.x ships its tp plan with the embedding alone
(``{"embed_tokens": "embedding_rowwise"}``), so nothing of the attention would be split and the decoder layer could
not be sequence-sharded around its MoE block. :func:`sink_attention_plan` supplies the split a head-parallel
attention takes (q/k/v column-parallel, o row-parallel: its bias added once, after the reduction) for the
projections the config's plan leaves out, and :class:`HeadShardedSinks` shards ``sinks`` with the heads:

- the Parameter becomes a ``Shard(0)`` ``DTensor`` over tp (checkpoints and FSDP know its layout);
- the module's class becomes a subclass (of the same name) whose ``sinks`` attribute reads this rank's shard of
  the tp ``DTensor`` (``to_local()``, the gradient flowing back into the ``DTensor``), so the class's own
  attention, ``transformers``' eager function (which reads ``module.sinks``) and the context-parallel one (handed
  ``s_aux=self.sinks``) see this rank's heads' sinks beside this rank's heads. The Parameter keeps its name
  (``self_attn.sinks``) in ``_parameters``, where FSDP, the optimizer and checkpoints find it; FSDP's one read by
  attribute (of its sharded Parameter, over its data mesh and tp) gets the Parameter (:func:`_local_sinks`).

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
# an attention class -> its subclass that reads the sinks as this rank's shard
_LOCAL_SINKS_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


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
    """``sinks`` sharded with the heads (``Shard(0)`` over tp) and read as this rank's shard (see the module
    docstring); then ``then``, the module's own style in the plan (the region's sequence gather), if any."""

    def __init__(self, then: ParallelStyle | None = None) -> None:
        super().__init__()
        self.then = then

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module._parameters.get(SINKS)
        if sinks is None or sinks.ndim != 1:
            raise TypeError(f"{type(module).__name__} holds no per-head sinks to shard")
        sharded = distribute_tensor(sinks.detach(), device_mesh, [Shard(0)])
        module._parameters[SINKS] = nn.Parameter(sharded, requires_grad=sinks.requires_grad)
        module.__class__ = _local_sinks_class(type(module))
        return module if self.then is None else self.then._apply(module, device_mesh)


def _local_sinks(module: nn.Module) -> Any:
    """``module.sinks``: this rank's shard where the Parameter is the tp ``DTensor`` (on the tp mesh alone, as the
    plan made it and as FSDP hands it to the forward once gathered); the Parameter itself otherwise (FSDP's shard
    over its data mesh and tp, which FSDP reads back by this name; a stand-in the initialisation puts there)."""
    sinks = module._parameters[SINKS]
    if isinstance(sinks, DTensor) and len(sinks.placements) == 1:
        return sinks.to_local()
    return sinks


def _local_sinks_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with ``sinks`` read by :func:`_local_sinks`, a property: no forward changes the module's state for
    it, so a compiled layer traces it (recompute included) without a graph break. Named as ``cls``, so messages
    and ``repr`` name the family's class; one per class."""
    if cls not in _LOCAL_SINKS_CLASSES:
        attributes = {SINKS: property(_local_sinks), "__module__": cls.__module__}
        _LOCAL_SINKS_CLASSES[cls] = type(cls.__name__, (cls,), attributes)
    return _LOCAL_SINKS_CLASSES[cls]
