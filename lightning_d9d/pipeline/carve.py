"""Carving a model into this rank's pipeline stages, keeping global parameter names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.pipeline.schedules import PipelineConfig
from lightning_d9d.pipeline.split import balanced_stage_layers, stages_of_rank
from lightning_d9d.pipeline.traits import PipelineSplittable


@dataclass(frozen=True)
class StageLayout:
    """How the layers are spread over stages: explicit counts, or balanced with the embedding and the head
    costing ``embedding_weight`` / ``head_weight`` layers."""

    layers_per_stage: Sequence[int] | None = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0


# An adapter that cuts a module which does not implement PipelineSplittable itself (the transformers adapter's
# ``hf_pipeline_for``): the module's splittable view, or None when it does not know the module.
SplittableView = Callable[[nn.Module], PipelineSplittable | None]


def splittable_view(module: nn.Module, views: Sequence[SplittableView] = ()) -> PipelineSplittable | None:
    """``module`` itself if it implements ``PipelineSplittable``, else the first view one of ``views`` gives."""
    if isinstance(module, PipelineSplittable):
        return module
    for view in views:
        found = view(module)
        if found is not None:
            return found
    return None


def find_splittable(
    owner: nn.Module, views: Sequence[SplittableView] = ()
) -> tuple[nn.Module, PipelineSplittable]:
    """The one child of ``owner`` (the LightningModule) that can be cut into pipeline stages, and what cuts it
    (:func:`splittable_view`)."""
    candidates = [
        (child, view) for child in owner.children() if (view := splittable_view(child, views)) is not None
    ]
    if len(candidates) != 1:
        raise ValueError(
            f"pp > 1 needs exactly one child module of {type(owner).__name__} that implements "
            f"lightning_d9d.pipeline.PipelineSplittable or is a transformers causal LM (found "
            f"{len(candidates)}); our models do"
        )
    return candidates[0]


def carve_stages(
    model: PipelineSplittable, config: PipelineConfig, dims: ParallelDims, layout: StageLayout
) -> dict[int, nn.Module]:
    """Trim ``model`` in place to this rank's layers and return one stage module per local stage.

    The stages share the model's submodules, so every parameter keeps its global name and checkpoints do not
    depend on the split.
    """
    num_stages = config.num_stages(dims.pp)
    layers = balanced_stage_layers(
        model.num_pipeline_layers,
        num_stages,
        embedding_weight=layout.embedding_weight,
        head_weight=layout.head_weight,
        layers_per_stage=layout.layers_per_stage,
    )
    pp_rank = dims.mesh_for("pp").get_local_rank()
    local = stages_of_rank(pp_rank, dims.pp, config.stages_per_rank, v_shape=config.v_shape)
    last = num_stages - 1
    model.pipeline_keep(
        sorted(i for stage in local for i in layers[stage]), first=0 in local, last=last in local
    )
    return {
        stage: model.pipeline_stage(layers[stage], first=stage == 0, last=stage == last) for stage in local
    }
