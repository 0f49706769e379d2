"""A transformers causal LM trained on one layout of the strategy's plans, without the Trainer, and the comparison
of such a run with the one-rank run of the same model: the body of the two-GPU layout tests
(``tests/gpu/test_two_gpu_layouts_gpu.py``, NCCL, bf16) and of their CPU dry run (``test_hf_layout_runs.py``,
gloo, fp32). Rank ``r`` runs on ``cuda:r`` when the group is NCCL's, on the CPU otherwise.

:func:`train_layout` does per step what ``D9DStrategy`` does around ``model_loss`` (its own pieces: the loss
layer, ``lightning_d9d/loss/``, for the cp split and the token weights, the pipeline runner under pp): the model built
by ``tiny_hf.tiny_causal_lm`` (seeded, the same start on every run), the adapter's plans (``parallelize_hf``; under
pp the stages carved from the model and each planned, as the strategy does), ``tiny_hf.batch``'s seeded batches
(each data rank its rows, each cp rank its load-balanced part of every row), ``tiny_hf.optimizer_for``'s AdamW.
It records per step the token-mean loss of the global batch and the gradient norm before the optimizer step, and
the parameters at the end; the reference is the same body on one rank (:meth:`Layout.one_rank`), the strategy's
one-GPU run of the same model.

``precision``: ``"fp32"``, or ``"bf16"``: the strategy's ``bf16-mixed`` (FSDP2's ``MixedPrecisionPolicy``:
parameters cast to bf16 for forward and backward, gradients reduced in fp32; fp32 master weights and optimizer
state), on every layout and on the one-rank run alike.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from distributed import rank_device
from tiny_hf import META_SEED, ROWS, SEQ, VOCAB, batch, optimizer_for, tiny_causal_lm, tiny_config
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_d9d import loss as loss_layer
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.models.hf.pipeline import hf_pipeline_for
from lightning_d9d.modules.attention import Attention
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.moe import MoE
from lightning_d9d.modules.moe.choose import ENV_VAR as DISPATCH_ENV_VAR
from lightning_d9d.pipeline import PipelineRunner, StageLayout, carve_stages, check_pipeline_config
from lightning_d9d.pipeline.checks import check_pipeline_model, tied_parameters
from lightning_d9d.plans import ParallelOptions, maybe_loss_parallel, split_batch
from lightning_d9d.plans.lora import LoRA, apply_lora
from lightning_d9d.strategies.grad_norm import group_parameters_by_mesh, total_grad_norm


@dataclass(frozen=True)
class Shape:
    """The model and the data: ``tiny_hf.tiny_config``'s overrides (``model``; ``moe`` on top for Qwen3-MoE),
    ``layers`` decoder layers, ``steps`` batches of ``rows`` x ``seq`` tokens."""

    layers: int = 2
    rows: int = ROWS
    seq: int = SEQ
    steps: int = 6
    model: dict[str, Any] = field(default_factory=dict)
    moe: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return int(self.model.get("vocab_size", VOCAB))

    def overrides(self, family: str) -> dict[str, Any]:
        return {**self.model, **(self.moe if family in ("qwen3_moe", "ours_qwen3_moe") else {})}


@dataclass(frozen=True)
class Layout:
    """One layout on ``world`` ranks: ``ParallelDims``' degrees (``dims``; ``{}`` on one rank is the reference) and
    what the strategy's options choose there."""

    family: str  # "qwen3" or "qwen3_moe" (tiny_hf.FAMILIES), or our own models of that shape (OURS)
    world: int = 1
    dims: dict[str, int] = field(default_factory=dict)
    context_attention: str = "auto"  # under cp: "torch_ring" (CUDA only) or "all_gather"
    fp8: str | None = None  # "tensorwise" or "rowwise"
    # under ep: the dispatcher by name ($LIGHTNING_D9D_MOE_DISPATCH); None: all_to_all
    dispatch: str | None = None
    schedule: str = "1F1B"  # under pp
    microbatches: int = 2
    micro_steps: int = 1  # forward + backward per optimizer step, each on its part of the rank's rows
    lora: LoRA | None = None  # adapters on the layers it names, applied before every other plan
    expert_tensor_parallel: bool = False  # under tp: each expert split over the tp ranks
    # under cp with context_attention="heads": cp does not divide a rank's query heads (heads split over part of
    # the cp ranks, keys gathered over the rest)
    hybrid_heads: bool = False

    def one_rank(self) -> Layout:
        """The one-rank run this layout is held to: the same model and FP8 recipe, no parallelism. Under FP8 it
        takes each data rank's rows as a micro-step of its own: float8's dynamic scales are taken over the rows
        a matmul sees, so one process multiplying the whole batch at once trains another (equally good) model."""
        data_ranks = self.dims.get("dp_shard", 1) * self.dims.get("dp_replicate", 1)
        return Layout(self.family, fp8=self.fp8, micro_steps=data_ranks if self.fp8 else 1, lora=self.lora)


# The two-GPU tests' models: 4 layers of hidden 512 (MLP 1536; 8 query and 4 key-value heads of 64; Qwen3-MoE: 8
# experts of width 256, top-2), vocabulary 4096, tiny_hf's initialisation (std 0.1), 8 batches of 4 x 128 tokens.
# Small enough to start and train in seconds, large enough that bf16 rounds as in a real model (sums over 512 to
# 1536 terms, a softmax over 4096 logits).
TWO_GPU = Shape(
    layers=4,
    rows=4,
    seq=128,
    steps=8,
    model={
        "vocab_size": 4096,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 128,
    },
    moe={"num_experts": 8, "moe_intermediate_size": 256},
)

# The two-rank layouts (tp with sequence and loss parallelism as the adapter plans it, both cp paths,
# 1F1B over two stages, the experts over ep by all-to-all and by DeepEP, each expert split over tp, FP8 at
# dp_shard=2).
LAYOUTS: dict[str, Layout] = {
    "tp2": Layout("qwen3", 2, {"tp": 2}),
    "cp2_torch_ring": Layout("qwen3", 2, {"cp": 2}, context_attention="torch_ring"),
    "cp2_all_gather": Layout("qwen3", 2, {"cp": 2}, context_attention="all_gather"),
    "pp2_1F1B": Layout("qwen3", 2, {"pp": 2}),
    "ep2_all_to_all": Layout("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}),
    "ep2_deepep": Layout("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}, dispatch="deepep"),
    "tp2_etp": Layout("qwen3_moe", 2, {"tp": 2}, expert_tensor_parallel=True),  # each expert split over tp
    "dp_shard2_fp8_tensorwise": Layout("qwen3", 2, {"dp_shard": 2}, fp8="tensorwise"),
    "dp_shard2_fp8_rowwise": Layout("qwen3", 2, {"dp_shard": 2}, fp8="rowwise"),
}

# Beyond the two-GPU ones, for several ranks sharing one GPU (tests/gpu/test_shared_gpu_layouts_gpu.py): FSDP
# alone, the zero-bubble V schedule (two stages a rank: 4 layers), tp x dp_shard on 4 ranks, and our own
# models in the layouts above.
SHARED_GPU_LAYOUTS: dict[str, Layout] = {
    **{name: layout for name, layout in LAYOUTS.items() if layout.dispatch != "deepep"},
    "dp_shard2": Layout("qwen3", 2, {"dp_shard": 2}),
    "pp2_ZBVZeroBubble": Layout("qwen3", 2, {"pp": 2}, schedule="ZBVZeroBubble", microbatches=4),
    "tp2_dp_shard2": Layout("qwen3", 4, {"tp": 2, "dp_shard": 2}),
    "ours_dp_shard2": Layout("ours_qwen3", 2, {"dp_shard": 2}),
    "ours_tp2": Layout("ours_qwen3", 2, {"tp": 2}),
    "ours_cp2_torch_ring": Layout("ours_qwen3", 2, {"cp": 2}, context_attention="torch_ring"),
    "ours_cp2_all_gather": Layout("ours_qwen3", 2, {"cp": 2}, context_attention="all_gather"),
    "ours_pp2_1F1B": Layout("ours_qwen3", 2, {"pp": 2}),
    "ours_pp2_ZBVZeroBubble": Layout("ours_qwen3", 2, {"pp": 2}, schedule="ZBVZeroBubble", microbatches=4),
    "ours_tp2_dp_shard2": Layout("ours_qwen3", 4, {"tp": 2, "dp_shard": 2}),
    "ours_ep2_all_to_all": Layout("ours_qwen3_moe", 2, {"dp_shard": 2, "ep": 2}),
    "ours_tp2_etp": Layout("ours_qwen3_moe", 2, {"tp": 2}, expert_tensor_parallel=True),
    "ours_dp_shard2_fp8_tensorwise": Layout("ours_qwen3", 2, {"dp_shard": 2}, fp8="tensorwise"),
}


def train_layout(layout: Layout, shape: Shape, precision: str) -> dict[str, Any] | None:
    """On every rank of a ``layout.world``-rank group: train as the module docstring says. Rank 0 returns the
    per-step ``losses`` and ``norms``, the full ``params`` at the end (every stage's under pp, fp32 on the CPU)
    and ``facts``, what shows on each rank that the layout was applied; the other ranks return None."""
    device = rank_device()
    if device.type == "cuda" and precision == "fp32":  # fp32 as on the CPU: no TF32 rounding of the matmuls
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if layout.dispatch is not None:
        os.environ[DISPATCH_ENV_VAR] = layout.dispatch  # read when parallelize_hf builds the dispatchers
    model = start_model(layout, shape).to(device)
    dims = ParallelDims(**layout.dims).resolve(dist.get_world_size()).build_mesh(device.type)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = ParallelOptions(
        mp_policy=mp_policy if precision == "bf16" else None,
        context_attention=layout.context_attention,
        fp8=layout.fp8,
        expert_tensor_parallel=layout.expert_tensor_parallel,
    )
    runner = None
    # under pp as D9DStrategy does: the stages carved from the model, each planned, the schedule over them
    if dims.pp_enabled:
        config = check_pipeline_config(dims.pp, layout.schedule, layout.microbatches, None)
        # the strategy's checks, on the model as a LightningModule's child
        check_pipeline_model(
            nn.ModuleDict({"model": model}), config, dims.pp, StageLayout(), (hf_pipeline_for,)
        )
        splittable = model if layout.family in OURS else hf_pipeline_for(model)
        assert splittable is not None
        tied = tied_parameters(model)
        stages = carve_stages(splittable, config, dims, StageLayout())
        for stage in stages.values():
            stage.parallelize(dims, options)  # type: ignore[operator]
        runner = PipelineRunner(config, model, stages, dims, device, tied)
    elif layout.family in OURS:
        model.parallelize(dims, options)  # type: ignore[operator]
    else:
        parallelize_hf(model, dims, options)

    optimizer = optimizer_for(model.parameters())
    dp_rank, dp = dims.mesh_for("dp").get_local_rank(), dims.dp
    rows = slice(dp_rank * shape.rows // dp, (dp_rank + 1) * shape.rows // dp)
    split = loss_layer.context_split(dims)
    loss_mesh = dims.mesh_for("loss")
    pipelined = runner is not None
    losses, norms = [], []
    for step in range(shape.steps):
        ids, labels = batch(step, rows=shape.rows, seq=shape.seq, vocab=shape.vocab)
        inputs: Any = {"input_ids": ids[rows].to(device)}
        target = labels[rows].to(device)
        if split is not None:
            inputs, target = split_batch(split, inputs, target)
        count = loss_layer.global_count(dims, causal_lm_loss, target, needed=False, pipelined=pipelined)
        scale = loss_layer.item_scale(dims, count, pipelined=pipelined)
        if runner is not None:  # forward and backward inside the schedule
            assert layout.micro_steps == 1
            loss = runner.train_step(
                (inputs["input_ids"],), target, causal_lm_loss, accumulate=1, item_scale=scale
            )
        else:
            loss = torch.zeros((), device=device)
            pieces = target.shape[0] // layout.micro_steps
            # each micro-step weighed by its share of the tokens
            for start in range(0, target.shape[0], pieces):
                part = slice(start, start + pieces)
                share = causal_lm_loss.count(target[part]) / causal_lm_loss.count(target)
                piece = loss_layer.forward_loss(
                    model,
                    {name: value[part] for name, value in inputs.items()},
                    target[part],
                    causal_lm_loss,
                    tensor_parallel=dims.tp_enabled,
                    scale=scale,
                )
                with maybe_loss_parallel(dims.tp_enabled):
                    (piece * share).backward()
                loss = loss + (piece * share).detach()
        stage_peers = runner.grad_norm_groups if runner is not None else []
        norm = total_grad_norm(
            group_parameters_by_mesh(model.parameters()), extra_groups=stage_peers, device=device
        )
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().clone()
        if loss_mesh.size() > 1:  # each rank weighed by its share of the tokens: the mean is the token mean
            dist.all_reduce(value, group=loss_mesh.get_group())
            value /= loss_mesh.size()
        losses.append(float(value))

    params = full_parameters(model)
    facts = layout_facts(model)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"facts": facts, "params": params if dims.pp_enabled else {}})
    if dist.get_rank() != 0:
        return None
    if dims.pp_enabled:  # every stage's parameters, by their global names
        params = {name: tensor for part in gathered for name, tensor in part["params"].items()}
    return {"losses": losses, "norms": norms, "params": params, "facts": [part["facts"] for part in gathered]}


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective per ``DTensor``), fp32 on the CPU, by its name in the unwrapped model."""
    return {
        name.replace("._checkpoint_wrapped_module", ""): (p.full_tensor() if isinstance(p, DTensor) else p)
        .detach()
        .float()
        .cpu()
        for name, p in model.named_parameters()
    }


def layout_facts(model: nn.Module) -> dict[str, Any]:
    """What shows that a layout was applied on this rank: the mesh dims the parameters are split or replicated
    over, the decoder layers held, the context-parallel attention paths, the expert dispatchers and the number of
    float8 linear layers (the names of the classes found)."""
    modules = list(model.modules())
    return {
        "meshes": sorted(
            {
                dim
                for p in model.parameters()
                if isinstance(p, DTensor)
                for dim in p.device_mesh.mesh_dim_names or ()
            }
        ),
        "layers": sorted(
            {int(name.split(".")[2]) for name, _ in model.named_parameters() if ".layers." in name}
        ),
        # the adapter's attributes on transformers' modules; our attention's ``context`` and MoE's ``dispatcher``
        "attention": sorted(
            {type(m._d9d_context_attention).__name__ for m in modules if hasattr(m, "_d9d_context_attention")}
            | {
                type(m.context).__name__
                for m in modules
                if isinstance(m, Attention) and m.context is not None
            }
        ),
        "dispatchers": sorted(
            (
                {type(m._d9d_dispatcher).__name__ for m in modules if hasattr(m, "_d9d_dispatcher")}
                | {type(m.dispatcher).__name__ for m in modules if isinstance(m, MoE)}
            )
            - {"LocalDispatcher"}  # the experts all on this rank: no tokens move
        ),
        "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in modules),
    }


def assert_applied(layout: Layout, ranks: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """``ranks``' facts (:func:`layout_facts`, by rank) show ``layout`` applied, and ``reference``'s (the one-rank
    run's) the same FP8 conversion: tp's mesh, the context-parallel attention path asked for, each pipeline rank
    its own half of the layers, the experts over ep with the dispatcher asked for, the float8 linear layers."""
    assert len(ranks) == layout.world
    dims = layout.dims
    for facts in ranks:
        assert ("tp" in facts["meshes"]) == (dims.get("tp", 1) > 1), facts
        assert ("ep" in facts["meshes"]) == (dims.get("ep", 1) > 1), facts
        expected_attention = {
            "all_gather": ["AllGatherAttention"],
            "torch_ring": ["TorchRingAttention"],
            "heads": ["HeadParallelAttention"],
        }
        if layout.hybrid_heads:
            expected_attention["heads"] = ["HybridHeadParallelAttention"]
        assert facts["attention"] == (
            expected_attention[layout.context_attention] if dims.get("cp", 1) > 1 else []
        )
        expected_dispatch = {"deepep": "DeepEPDispatcher", None: "AllToAllDispatcher"}[layout.dispatch]
        if layout.expert_tensor_parallel:  # the local dispatcher inside the tp gather and reduce-scatter
            expected_dispatch = "ExpertTensorParallelDispatcher"
        moved = dims.get("ep", 1) > 1 or layout.expert_tensor_parallel
        assert facts["dispatchers"] == ([expected_dispatch] if moved else []), facts
        assert (facts["float8_linears"] > 0) == (layout.fp8 is not None), facts
        assert facts["float8_linears"] == reference[0]["float8_linears"], (facts, reference)
    held = [facts["layers"] for facts in ranks]
    if dims.get("pp", 1) > 1:  # each pipeline rank its own stages' layers, no layer on two, all of them held
        stages = sorted({tuple(layers) for layers in held})
        assert all(held) and len(stages) == dims["pp"], held
        assert sorted(layer for stage in stages for layer in stage) == reference[0]["layers"], held
    else:
        assert all(layers == reference[0]["layers"] for layers in held)


# Our models, each of the shape of the transformers family named beside it (its tiny_hf config's fields).
OURS: dict[str, tuple[str, type, type[nn.Module]]] = {
    "ours_qwen3": ("qwen3", Qwen3Config, Qwen3ForCausalLM),
    "ours_qwen3_moe": ("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def start_model(layout: Layout, shape: Shape) -> nn.Module:
    """The seeded model every run of ``layout`` starts from, before any plan (with its adapters, seeded alike)."""
    if layout.family in OURS:
        family, config_class, model_class = OURS[layout.family]
        hf = tiny_config(family, layers=shape.layers, **shape.overrides(family))
        names = [f.name for f in dataclasses.fields(config_class) if hasattr(hf, f.name)]
        model = model_class(config_class(**{name: getattr(hf, name) for name in names}))
        model.init_weights(seed=META_SEED)  # type: ignore[operator]
    else:
        model = tiny_causal_lm(layout.family, layers=shape.layers, **shape.overrides(layout.family))
    if layout.lora is not None:
        apply_lora(model, layout.lora, seed=0)
    return model


def start_parameters(layout: Layout, shape: Shape) -> dict[str, torch.Tensor]:
    """The parameters every run starts from (the seeded model, before any plan)."""
    model = start_model(layout, shape)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def differences(
    got: dict[str, Any], expected: dict[str, Any], start: dict[str, torch.Tensor]
) -> dict[str, float]:
    """``got`` against ``expected`` (the one-rank run), every step: the largest relative difference of a step's
    loss and of its gradient norm, and how far the parameters moved from ``start`` otherwise than the reference's
    did (``||(got - start) - (expected - start)|| / ||expected - start||`` over all of them: 0 for the same
    training, 1 for a run that did not move). Also ``steps``, how many steps were compared, ``moved``, the
    reference's ``||expected - start||``, and the relative change of its loss from the first step to the last,
    ``learnt``."""
    assert set(got["params"]) == set(expected["params"]) == set(start)
    moved_squared = apart_squared = 0.0
    for name, reference in expected["params"].items():
        moved_squared += float((reference - start[name]).double().square().sum())
        apart_squared += float((got["params"][name] - reference).double().square().sum())
    losses = [abs(a - b) / abs(b) for a, b in zip(got["losses"], expected["losses"], strict=True)]
    norms = [abs(a - b) / abs(b) for a, b in zip(got["norms"], expected["norms"], strict=True)]
    assert len(losses) == len(norms), (got["losses"], got["norms"])
    return {
        "steps": len(losses),
        "loss": max(losses),
        "norm": max(norms),
        "update": math.sqrt(apart_squared / moved_squared),
        "moved": math.sqrt(moved_squared),
        "learnt": abs(expected["losses"][-1] - expected["losses"][0]) / expected["losses"][0],
    }


def train_layouts(runs: list[tuple[str, Layout, Shape]], precision: str) -> dict[str, Any] | None:
    """:func:`train_layout` for each named run in turn on this one group (a launch costs a GPU rank seconds of
    imports and CUDA set-up; the runs take less). Rank 0 returns each run's result by name, or the traceback of
    the first failed rank's traceback (the next run starts on new meshes)."""
    results: dict[str, Any] = {}
    for name, layout, shape in runs:
        os.environ.pop(DISPATCH_ENV_VAR, None)  # each run names its dispatcher or takes the default
        error = None
        try:
            results[name] = train_layout(layout, shape, precision)
        except Exception:
            error = f"rank {dist.get_rank()}: {traceback.format_exc()}"
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if any(errors):
            results[name] = next(text for text in errors if text)
        _clean_up_run()
    return results if dist.get_rank() == 0 else None


def _clean_up_run() -> None:
    """A run's garbage (reference cycles of modules, hooks and DTensors), collected before the next run: left, a
    hundred runs ran their last ones 10x slower than their first (tests/models/hf/test_hf_family_matrix.py's
    2-rank runs: 100 s in all, 60 s collected after each)."""
    gc.collect()
