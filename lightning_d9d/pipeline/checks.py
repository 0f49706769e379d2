"""Pipeline settings checked against the model before any process or collective depends on them.

Every check here is pure (no process group, no data): the strategy runs it in the launching process before the
other processes start when the model is built already, and on every rank before the first collective otherwise
(a model built in ``configure_model`` exists only after the process group is up). Every rank reaches the same
verdict, so no rank waits in a collective for one that stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_d9d.pipeline.carve import SplittableView, StageLayout, find_splittable, splittable_view
from lightning_d9d.pipeline.schedules import PipelineConfig
from lightning_d9d.pipeline.split import balanced_stage_layers, rank_of_stage


def tied_parameters(module: nn.Module) -> list[tuple[str, str]]:
    """Pairs of names under which ``module`` holds one and the same parameter (tied weights)."""
    first_name: dict[int, str] = {}
    pairs = []
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in first_name:
            pairs.append((first_name[id(parameter)], name))
        else:
            first_name[id(parameter)] = name
    return pairs


def has_splittable_child(owner: nn.Module, views: Sequence[SplittableView] = ()) -> bool:
    """Whether ``owner`` holds its pipelined model yet (not when it is built later, in ``configure_model``)."""
    return any(splittable_view(child, views) is not None for child in owner.children())


def check_pipeline_model(
    owner: nn.Module,
    config: PipelineConfig,
    pp: int,
    layout: StageLayout,
    views: Sequence[SplittableView] = (),
) -> None:
    """Raise ``ValueError`` with the numbers and the fix if ``owner``'s pipelined model cannot be split into
    ``pp * stages_per_rank`` stages: fewer layers than stages, ``layers_per_stage`` that do not fit, or tied
    parameters where the schedule puts the first and last stage on one rank (elsewhere their copies train as one:
    :mod:`lightning_d9d.pipeline.tied`)."""
    if pp <= 1:
        return
    model, splittable = find_splittable(owner, views)
    balanced_stage_layers(
        splittable.num_pipeline_layers,
        config.num_stages(pp),
        embedding_weight=layout.embedding_weight,
        head_weight=layout.head_weight,
        layers_per_stage=layout.layers_per_stage,
    )
    tied = tied_parameters(model)
    last = config.num_stages(pp) - 1
    if tied and rank_of_stage(0, pp, config.stages_per_rank, v_shape=config.v_shape) == rank_of_stage(
        last, pp, config.stages_per_rank, v_shape=config.v_shape
    ):
        shown = ", ".join(f"{a} = {b}" for a, b in tied[:3])
        raise ValueError(
            f"pp={pp}: {type(model).__name__} ties parameters ({shown}), and the {config.schedule} schedule "
            "puts the first and the last stage on one rank as two FSDP units, which cannot share a parameter. "
            "Use a schedule that ends on another rank (1F1B, Interleaved1F1B, ...), or untie them "
            "(tie_word_embeddings=False)"
        )


def check_batches_split(loader: object, microbatches: int, limit_batches: int | float) -> None:
    """Raise ``ValueError`` if a training batch this rank's ``loader`` will yield cannot be cut into
    ``microbatches`` equal microbatches: its ``batch_size``, or the partial last batch of the epoch (without
    ``drop_last``), which would otherwise fail only when reached, at the end of the first epoch.

    ``limit_batches`` is the Trainer's ``limit_train_batches`` (a partial last batch it cuts off is never drawn).
    Loaders without a ``batch_size`` and a sized sampler (custom batch samplers, iterable datasets) are checked
    batch by batch, when each one arrives.
    """
    from collections.abc import Sized

    from lightning_d9d.pipeline.runner import check_microbatch_split  # the runner checks every batch with it

    batch_size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "sampler", None)
    if not isinstance(batch_size, int) or not isinstance(sampler, Sized):
        return
    check_microbatch_split(batch_size, microbatches)
    samples = len(sampler)
    last = samples % batch_size
    if not last or getattr(loader, "drop_last", False):
        return
    batches = -(-samples // batch_size)
    drawn = int(batches * limit_batches) if isinstance(limit_batches, float) else min(batches, limit_batches)
    if drawn == batches and last % microbatches:
        raise ValueError(
            f"this rank's training data ends in a partial batch of {last} samples ({samples} samples per rank, "
            f"batch size {batch_size}), which cannot be cut into {microbatches} microbatches: pass "
            "drop_last=True to the DataLoader, or make the samples per rank a multiple of the batch size"
        )
