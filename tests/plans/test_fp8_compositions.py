"""FP8 (``D9DStrategy(fp8=...)``, ``plans/fp8.py``) composed with the rest of a plan, on CPU, each against one process
with torchao's conversion applied by hand (``fp8_runs.py``, ``float8_training.py``): activation recompute (full and selective), the
per-block ``torch.compile`` (dynamo and AOTAutograd through our plan; Inductor's float8 casts on a float8 block),
FSDP x tp on a 2-D mesh (dp_shard=2 x tp=2), context parallelism (cp=2), a pipeline (pp=2, 1F1B), HSDP
(dp_replicate=2 x dp_shard=2), full recompute of compiled blocks under tp=2, and our Qwen3-MoE under tp=2, ep=2 and
ep=2 x tp=2 (its float8 linears: attention and the dense
layer; experts in bf16 off the GPU, router unconverted). Each run
also says how often the plan converted: once (the model's plan converts, ``parallelize_blocks`` finds nothing
left)."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from float8_training import (
    GRADIENTS,
    STEPS,
    TENSORWISE_TP_GRADIENTS,
    assert_first_step_agrees,
    batches,
    float8_names,
    full_gradients,
    full_parameters,
    gloo_gathers_float8_as_bytes,
    gradient_differences,
    trained,
)
from fp8_runs import (
    TP_LR,
    converted_by_hand,
    first_attention_input,
    reference_run,
    tiny_model,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, local_loss, maybe_loss_parallel

pytest.importorskip("torchao", reason="torchao is a test dependency (pyproject's test extra)")
RECIPES = ["tensorwise", "rowwise"]
LINEARS = 14  # 7 float8 linear layers (q, k, v, o, gate, up, down) in each of the tiny Qwen3's 2 blocks


@contextlib.contextmanager
def conversion_lines() -> Iterator[list[str]]:
    """The plan's log lines that report converted linears, while the block runs (this process)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "linear layers train in float8" in record.getMessage():
                lines.append(record.getMessage())

    logger = logging.getLogger("lightning_d9d.plans")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def planned(
    recipe: str, degrees: dict[str, int], *, moe: bool = False, **options: Any
) -> tuple[Any, ParallelDims, list[str]]:
    """The seeded tiny Qwen3 (``moe``: Qwen3-MoE) under its own plan, over the mesh of ``degrees`` (all of this
    process group's ranks), with ``fp8=recipe`` and ``options``; and the plan's conversion log lines."""
    dims = ParallelDims(**degrees).resolve(dist.get_world_size()).build_mesh("cpu")
    model = tiny_model(moe=moe)
    with conversion_lines() as lines:
        model.parallelize(dims, ParallelOptions(fp8=recipe, **options))
    return model, dims, lines


def assert_equal_runs(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert run["losses"] == reference["losses"]
    for key in ("grads", "params"):
        assert run[key].keys() == reference[key].keys()
        for name, tensor in reference[key].items():
            assert torch.equal(run[key][name], tensor), (key, name)


# ---------------------------------------------------------------------------------- recompute, compile
class CountMatmuls(TorchDispatchMode):
    """How many matmuls run (a float8 linear's products reach the dispatcher as ``aten.mm`` on torchao's float8
    tensors: selective recompute's policy sees them so, and this mode too)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def backward_matmuls(model: nn.Module, *, vocab_parallel: bool = False) -> int:
    """How many matmuls the first batch's backward runs (``vocab_parallel``: the logits come vocabulary-sharded,
    tp's, and the loss runs under ``loss_parallel``)."""
    inputs, labels = batches()[0]
    with maybe_loss_parallel(vocab_parallel):
        loss = local_loss(causal_lm_loss(model(inputs), labels))
        with CountMatmuls() as counter:
            loss.backward()
    model.zero_grad()
    return counter.count


@contextlib.contextmanager
def blocks_compiled_on_aot_eager(graphs: list[str], calls: list[int] | None = None) -> Iterator[None]:
    """Our plan's per-block ``Module.compile`` on ``aot_eager`` while the block runs (this process): dynamo traces
    each block and AOTAutograd splits forward and backward (the recompute inside) as under Inductor, without
    Inductor's code generation (half a minute for this model on a 2-core machine; Inductor's float8 casts have
    their own test below). The code of every graph dynamo hands over (with the graphs nested in it: a
    checkpointed region is one) goes to ``graphs``; with ``calls``, every later run of a compiled forward appends
    its graph's index there (a recompute around the compiled block runs it again in backward)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def kept(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        index = len(graphs)
        graphs.append("\n".join(m.code for m in graph.modules() if isinstance(m, torch.fx.GraphModule)))
        compiled = aot_eager(graph, example_inputs)
        if calls is None:
            return compiled

        def counted(*args: Any) -> Any:
            calls.append(index)
            return compiled(*args)

        return counted

    compile_module = nn.Module.compile

    def on_aot_eager(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        compile_module(self, *args, **{**kwargs, "backend": kept, "mode": None})

    nn.Module.compile = on_aot_eager  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.compile = compile_module  # type: ignore[method-assign]


# Bitwise comparisons need no 5 steps: 3 carry the optimizer's state through two updates (and keep 4 plans x 2
# recipes inside CI's time).
BITWISE_STEPS = 3
BLOCK_PLANS: dict[str, dict[str, Any]] = {
    "plain": {},
    "full recompute": {"activation_checkpointing": "full"},
    "selective recompute": {"activation_checkpointing": "selective"},
    "compiled, selective recompute": {"activation_checkpointing": "selective", "compile": True},
}


def block_plan_rank(recipe: str) -> dict[str, dict[str, Any]]:
    runs = {}
    for name, options in BLOCK_PLANS.items():
        graphs: list[str] = []
        with blocks_compiled_on_aot_eager(graphs):
            model, _, lines = planned(recipe, {"dp_shard": 1}, **options)
        run = trained(model, lr=TP_LR, steps=BITWISE_STEPS)
        runs[name] = {
            **run,
            "lines": lines,
            "float8": len(float8_names(model)),
            "graphs": graphs,
            "backward matmuls": backward_matmuls(model),
        }
    return runs


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_and_compile_train_the_float8_model_bitwise(recipe: str) -> None:
    """Full and selective recompute of the float8 blocks (converted before checkpointing wraps them) run the same
    float8 casts on the same tensors as the forward did, and compile=True traces the casts into the blocks'
    graph: losses, first gradients and parameters after 3 AdamW steps bitwise one eager process's (compiled on
    aot_eager, which runs the traced ops as eager does). Selective recompute keeps the float8 matmuls' outputs
    (its policy saves ``aten.mm``, which is how torchao's float8 products reach the dispatcher); full recompute
    runs each of them again."""
    (runs,) = run_distributed(block_plan_rank, 1, recipe, timeout=240)
    reference = trained(converted_by_hand(recipe), lr=TP_LR, steps=BITWISE_STEPS)
    for name, run in runs.items():
        assert run["float8"] == LINEARS, name
        assert run["lines"] == [f"fp8 ({recipe}): {LINEARS} linear layers train in float8"], name
        assert_equal_runs(run, reference)
    compiled = runs["compiled, selective recompute"]["graphs"]
    assert len(compiled) == 1  # the blocks share one graph, with no break
    assert "torch.float8_e4m3fn" in compiled[0]  # the casts are in it: compile sees them
    assert all(not run["graphs"] for name, run in runs.items() if "compiled" not in name)
    matmuls = {name: run["backward matmuls"] for name, run in runs.items()}
    assert matmuls["selective recompute"] == matmuls["plain"]
    assert matmuls["full recompute"] == matmuls["plain"] + LINEARS
    assert reference["losses"][-1] < 0.97 * reference["losses"][0]  # 5.56 -> 5.35 in 3 steps: it learns


def inductor_rank() -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
    for name, recipe in (("0", "tensorwise"), ("1", "rowwise")):
        convert_to_float8_training(
            block,
            module_filter_fn=lambda _, fqn, name=name: fqn == name,
            config=Float8LinearConfig.from_recipe_name(recipe),
        )
    compiled = copy.deepcopy(block)
    compiled.compile(fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=generator) * torch.linspace(0.1, 3, 64)  # grows along the features
    grad_output = torch.randn(32, 64, generator=generator)

    def products(module: nn.Module) -> list[torch.Tensor]:
        inputs = x.clone().requires_grad_()
        output = module(inputs)
        output.backward(grad_output)
        assert inputs.grad is not None
        return [output.detach(), inputs.grad, *(p.grad for p in module.parameters())]  # type: ignore[list-item]

    eager = products(block)
    got, code = run_and_get_code(products, compiled)
    return {"eager": eager, "compiled": got, "code": "\n".join(code)}


def test_inductor_compiles_float8_casts_on_cpu_as_eager_rounds_them() -> None:
    """Inductor on CPU (torch 2.13) generates the float8 casts itself, in C++ kernels that scale, clamp and convert
    to e4m3 (and e5m2: tensorwise's gradients), and calls ``_scaled_mm`` for the products; they round as eager
    does. A block of a tensorwise and a rowwise float8 linear: output, grad_input and both weights' gradients
    bitwise eager's. (Through our plan the tiny Qwen3 compiles under Inductor in about 30 s here: its first loss
    bitwise, first gradients within 9e-7 of their largest entry, as the fp32 model's under compile, from the
    fused fp32 ops around the linears (norms, attention); over 5 AdamW steps at lr=1e-3 such last bits flip a
    few float8 roundings: parameters 1e-4 (tensorwise) and 2e-3 (rowwise) apart, measured, not run here.)"""
    (run,) = run_distributed(inductor_rank, 1, timeout=300)
    for eager, compiled in zip(run["eager"], run["compiled"], strict=True):
        assert torch.equal(compiled, eager)
    assert "Float8_e4m3fn" in run["code"] and "Float8_e5m2" in run["code"]  # Inductor's own casts
    assert "_scaled_mm" in run["code"]


# ----------------------------------------------------------------------------------------- FSDP x tp, cp
def plan_rank(
    recipe: str, degrees: dict[str, int], parts: int, moe: bool = False, **options: Any
) -> dict[str, Any]:
    """Our plan over ``degrees`` (with ``options``) and 5 steps: each step's batch in ``parts`` parts; a
    data-parallel rank (FSDP, HSDP, ep: the ``dp`` view) runs its own, a rank without data parallelism all of them
    one after the other."""
    gloo_gathers_float8_as_bytes()
    model, dims, lines = planned(recipe, degrees, moe=moe, **options)
    seen = first_attention_input(model)
    if dims.dp > 1:
        dp = dims.mesh_for("dp").get_local_rank()
        ranks = range(dp, dp + 1)
    else:
        ranks = range(parts)
    run = trained(
        model, ranks, parts, vocab_parallel=dims.tp_enabled, lr=TP_LR, context=model.model.context_split
    )
    float8_weights = sum(
        type(getattr(p, "_local_tensor", p)).__name__ == "WeightWithDynamicFloat8CastTensor"
        for p in model.parameters()
    )  # FSDP all-gathers these in float8
    return {
        **run,
        **seen,
        "lines": lines,
        "float8": len(float8_names(model)),
        "float8 weights": float8_weights,
    }


def test_fsdp_x_tp_tensorwise_trains_as_one_process() -> None:
    """dp_shard=2 x tp=2, tensorwise: every scale is one process's (the weights' too: FSDP gathers them in their
    own dtype under tp, ``fp8.gathers_weights_in_float8``), so the first step is one process's on each dp half
    within fp32's last bits; and the whole run is tp=2's alone over the same halves one after the other (FSDP adds
    only the dp reduction, which halves and adds exactly as the one-after-the-other run does)."""
    ranks = run_distributed(plan_rank, 4, "tensorwise", {"dp_shard": 2, "tp": 2}, 2, timeout=240)
    tp_alone = run_distributed(plan_rank, 2, "tensorwise", {"tp": 2}, 2, timeout=240)[0]
    one = reference_run("tensorwise", parts=2, steps=1)  # compared on its first step
    for rank in ranks:
        assert rank["float8"] == LINEARS
        assert rank["lines"] == [f"fp8 (tensorwise): {LINEARS} linear layers train in float8"]
        assert rank["float8 inputs"] == STEPS  # the sequence gather moved float8 (torchao's float8 styles)
        # one process: the first loss within fp32's last bit at 5.56 (4.8e-7 measured), the first gradients
        # 4e-7 apart (measured; with the weights all-gathered in float8, scaled per tp shard: 0.16)
        assert abs(rank["losses"][0] - one["losses"][0]) <= 1e-6
        differences = gradient_differences(rank["grads"], one["grads"])
        assert max(differences.values()) < GRADIENTS, differences
        # tp alone: the same gradients and parameters, bitwise; the losses reported (a mean over 4 processes
        # here, over 2 there) within fp32's last bit. Later steps are not compared with one process, whose fp32
        # sums differ from tp's in the last bits, flipping float8 roundings that AdamW turns into lr-sized steps
        # (4e-4 in the loss at step 4, measured)
        torch.testing.assert_close(rank["losses"], tp_alone["losses"], rtol=0, atol=1e-6)
        assert_equal_runs({**rank, "losses": tp_alone["losses"]}, tp_alone)
    assert ranks[0]["losses"][-1] < 0.95 * ranks[0]["losses"][0]  # it learns


def test_fsdp_x_tp_rowwise_trains_as_one_process_with_per_shard_scales() -> None:
    """dp_shard=2 x tp=2, rowwise: what one process trains on each dp half when its float8 linears multiply per tp
    shard (``split_like_tp``; ``test_fp8.py`` shows why tp takes rowwise scales per shard)."""
    ranks = run_distributed(plan_rank, 4, "rowwise", {"dp_shard": 2, "tp": 2}, 2, timeout=240)
    per_shard = reference_run("rowwise", parts=2, tp=True, steps=1)  # compared on its first step
    for rank in ranks:
        assert rank["float8"] == LINEARS
        # the same float8 operands as the ranks', summed in another order: the first loss within 2 fp32 last bits
        # at 5.6 (9.5e-7 measured), first gradients 1e-5 apart (one flipped float8 rounding)
        assert_first_step_agrees(rank, per_shard)


@pytest.mark.parametrize("recipe", RECIPES)
def test_cp_trains_as_one_process_scaling_each_ranks_positions(recipe: str) -> None:
    """cp=2: each rank's linears see its own positions (load-balanced chunks), so their activation and gradient
    scales are taken over those, as data-parallel ranks take theirs over their rows; one process whose float8
    linears multiply each rank's positions on their own (``split_like_cp``) is the reference. The weights' scales
    are the whole weight's (FSDP over cp gathers them in float8 for tensorwise, its amax over the whole)."""
    ranks = run_distributed(plan_rank, 2, recipe, {"cp": 2}, 1, timeout=240)
    per_rank = reference_run(recipe, cp=2, steps=1)  # both compared on their first step
    whole = reference_run(recipe, steps=1)
    for rank in ranks:
        assert rank["float8"] == LINEARS
        # attention over the gathered keys and the loss over two halves sum in another order than one process:
        # the first loss within 3 fp32 last bits at 5.6 (1.4e-6 measured), first gradients 2.5e-7 apart
        assert_first_step_agrees(rank, per_rank, first_loss=5e-6)
    # the per-rank scales matter: one process scaling the whole sequence at once has other first gradients
    # (0.14 tensorwise, 2.4e-3 rowwise, measured)
    differences = gradient_differences(ranks[0]["grads"], whole["grads"])
    assert max(differences.values()) > 10 * GRADIENTS, differences


# ------------------------------------------------------------------------------------------------ pp
def pipeline_rank(recipe: str) -> dict[str, Any]:
    """pp=2 (1F1B, 2 microbatches of 2 rows): each rank carves its stage, whose plan converts its block; 5 AdamW
    steps. Returns the whole model's first gradients and parameters (both stages')."""
    from lightning_d9d.pipeline import PipelineRunner, StageLayout, carve_stages, check_pipeline_config

    dims = ParallelDims(pp=2).resolve(2).build_mesh("cpu")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    config = check_pipeline_config(2, "1F1B", 2, None)
    stages = carve_stages(model, config, dims, StageLayout())
    with conversion_lines() as lines:
        for stage in stages.values():
            stage.parallelize(dims, ParallelOptions(fp8=recipe))  # type: ignore[operator]
    runner = PipelineRunner(config, model, stages, dims, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=TP_LR)
    losses, grads = [], {}
    for step, (inputs, labels) in enumerate(batches()):
        losses.append(float(runner.train_step((inputs,), labels, causal_lm_loss, accumulate=1)))
        if step == 0:
            grads = full_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
    both: list[Any] = [None, None]
    dist.all_gather_object(both, (grads, full_parameters(model)))
    return {
        "losses": losses,
        "grads": {**both[0][0], **both[1][0]},
        "params": {**both[0][1], **both[1][1]},
        "lines": lines,
        "float8": len(float8_names(model)),
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_pp_trains_the_float8_model_bitwise_as_one_process_per_microbatch(recipe: str) -> None:
    """pp=2: each stage converts its own block, and each microbatch's matmuls scale over that microbatch, as one
    process running the microbatches one after the other does; the pipeline only moves activations and their
    gradients between the stages: losses, first gradients and parameters after 5 AdamW steps bitwise."""
    ranks = run_distributed(pipeline_rank, 2, recipe, timeout=240)
    reference = reference_run(recipe, parts=2)
    for rank in ranks:
        assert rank["float8"] == LINEARS // 2  # this stage's block
        assert rank["lines"] == [f"fp8 ({recipe}): {LINEARS // 2} linear layers train in float8"]
        assert_equal_runs(rank, reference)


# ----------------------------------------------------------------------------------------------- HSDP
def hsdp_rank() -> dict[str, dict[str, Any]]:
    """Both recipes in one launch of 4 processes (dp_replicate=2 x dp_shard=2), each data rank its own row."""
    return {recipe: plan_rank(recipe, {"dp_replicate": 2, "dp_shard": 2}, 4) for recipe in RECIPES}


def test_hsdp_trains_the_float8_model_as_one_process_per_data_rank() -> None:
    """dp_replicate=2 x dp_shard=2: each of the 4 data ranks' linears scale their activations and gradients over
    its own row, as one process running the 4 rows one after the other does (``reference_run(parts=4)``).

    The weights' scales (tensorwise, whose weights FSDP all-gathers in float8): torchao's
    ``fsdp_pre_all_gather`` takes the amax of each rank's shard and all-reduces it (MAX) over the mesh FSDP2
    hands it, which under HSDP is the *shard* mesh only (``FSDPParam._init_shard_mesh``: the HSDP mesh's last
    dim), not the replicate dim. That is the whole weight's amax: each replica's shard group holds the whole
    weight between them, and the replicas hold the same weight (their gradients are all-reduced over
    dp_replicate before the identical optimizer step), so the max over one replica's shards is one process's
    amax, bitwise. Rowwise gathers the weights in their own dtype and casts the gathered whole weight."""
    ranks = run_distributed(hsdp_rank, 4, timeout=240)
    for recipe in RECIPES:
        reference = reference_run(recipe, parts=4)
        for rank in ranks:
            run = rank[recipe]
            assert run["float8"] == LINEARS
            assert run["lines"] == [f"fp8 ({recipe}): {LINEARS} linear layers train in float8"]
            # the weights go through torchao's float8 all-gather where it is tensorwise
            assert run["float8 weights"] == (LINEARS if recipe == "tensorwise" else 0)
            # the same float8 operands, the loss and the dp mean summed in another order: losses within fp32's
            # last bit at 5.6 (4.8e-7 measured), first gradients 6.5e-8 apart, parameters 3.2e-7 (measured)
            torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=1e-6)
            differences = gradient_differences(run["grads"], reference["grads"])
            assert max(differences.values()) < 1e-6, differences
            for name, param in reference["params"].items():
                torch.testing.assert_close(run["params"][name], param, rtol=0, atol=1e-6, msg=name)
    assert ranks[0]["rowwise"]["losses"][-1] < 0.95 * ranks[0]["rowwise"]["losses"][0]  # it learns


# ------------------------------------------------------------------------------------- Qwen3-MoE: tp, ep
# q, k, v, o in each of the tiny Qwen3-MoE's 3 blocks; gate, up, down in its dense one (layer 1)
MOE_LINEARS = 15
# MoE routing is discontinuous: under tp the fp32 sums differ from one process's in their last bits (attention,
# the row-parallel halves), which flip a few float8 roundings; AdamW turns those into lr-sized steps, and from
# there a router's top-2 choice flips for a few tokens (measured by the routers' expert loads: tensorwise from
# step 2 on, 5 tokens; rowwise from step 3 on). A flipped choice moves the loss by up to 5.5e-4 (measured); the
# fp32 MoE under tp stays within fp32's last bit of one process at every step and flips none.
ROUTING_FLIPS = 2e-3


def test_moe_under_tp_tensorwise_trains_as_one_process() -> None:
    """Our Qwen3-MoE at tp=2, tensorwise: attention and the dense layer take torchao's float8 styles (every scale
    the whole tensor's, as for Qwen3); each MoE block routes its rank's positions through whole weights, its
    router (no ``nn.Linear``) and grouped experts (bf16 off the GPU) unconverted, and its gradients summed over
    tp. So the whole batch on one process is the reference, on the first step (``assert_first_step_agrees``); later
    steps part by the routing flips that float8's rounding sets off (``ROUTING_FLIPS``)."""
    ranks = run_distributed(plan_rank, 2, "tensorwise", {"tp": 2}, 1, True, timeout=240)
    reference = reference_run("tensorwise", moe=True, steps=1)  # both compared on their first step
    per_shard = reference_run("tensorwise", tp=True, moe=True, steps=1)
    for rank in ranks:
        assert rank["float8"] == MOE_LINEARS
        assert rank["lines"] == [f"fp8 (tensorwise): {MOE_LINEARS} linear layers train in float8"]
        assert rank["float8 inputs"] == STEPS  # the sequence gather moved float8 (torchao's float8 styles)
        assert_first_step_agrees(rank, reference, gradients=TENSORWISE_TP_GRADIENTS)
    # the scales matter: one process scaling per tp shard has other first gradients (0.25 measured)
    differences = gradient_differences(ranks[0]["grads"], per_shard["grads"])
    assert max(differences.values()) > 100 * GRADIENTS, differences
    assert ranks[0]["losses"][-1] < 0.95 * ranks[0]["losses"][0]  # it learns


def test_moe_under_tp_rowwise_trains_as_one_process_with_per_shard_scales() -> None:
    """Our Qwen3-MoE at tp=2, rowwise: torch's plain styles, so attention and the dense layer scale per tp shard
    where tp splits a contraction (``test_fp8.py``), as one process whose float8 linears multiply per shard
    (``split_like_tp``, which the MoE model's tensor plan fits: its float8 linears are Qwen3's); the MoE blocks
    as under tensorwise. The first steps within fp32's last bits, later ones apart by routing flips."""
    ranks = run_distributed(plan_rank, 2, "rowwise", {"tp": 2}, 1, True, timeout=240)
    per_shard = reference_run("rowwise", tp=True, moe=True)
    whole = reference_run("rowwise", moe=True)
    for rank in ranks:
        assert rank["float8"] == MOE_LINEARS
        assert rank["float8 inputs"] == 0  # torch's plain styles: the sequence gather moves fp32
        # losses 4.8e-7 and 1e-5 apart in the first 3 steps (measured; no routing flipped before step 3),
        # first gradients 3.4e-6 (a flipped float8 rounding: rowwise's row scales re-round a row)
        torch.testing.assert_close(rank["losses"][:3], per_shard["losses"][:3], rtol=0, atol=2e-5)
        differences = gradient_differences(rank["grads"], per_shard["grads"])
        assert max(differences.values()) < GRADIENTS / 10, differences
        torch.testing.assert_close(rank["losses"], per_shard["losses"], rtol=0, atol=ROUTING_FLIPS)
    # the per-shard scales matter: the whole-scale model's first loss is 1.8e-4 off, its first gradients 0.2
    # (measured: enough to flip a routing choice in the first step)
    assert abs(ranks[0]["losses"][0] - whole["losses"][0]) > 1e-5
    differences = gradient_differences(ranks[0]["grads"], whole["grads"])
    assert max(differences.values()) > 100 * GRADIENTS, differences


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_under_ep_trains_as_one_process_per_data_rank(recipe: str) -> None:
    """ep=2 (carved from dp_shard=2: the ep ranks are the data ranks): the experts split over both ranks, the
    tokens dispatched to them all-to-all; attention and the dense layer in float8 on each rank's own rows, so
    their scales are taken over those rows, as one process running each rank's rows on their own
    (``reference_run(parts=2)``, the router losses counted 1/2 a part) takes them. The experts stay in bf16 off
    the GPU and the router unconverted: ep moves their tokens, not their operands' scales. No routing flips
    (losses equal): the whole run within fp32's last bits."""
    ranks = run_distributed(plan_rank, 2, recipe, {"ep": 2}, 2, True, timeout=240)
    reference = reference_run(recipe, parts=2, moe=True)
    full_precision = reference_run(None, parts=2, moe=True)
    for rank in ranks:
        assert rank["float8"] == MOE_LINEARS
        assert rank["lines"] == [f"fp8 ({recipe}): {MOE_LINEARS} linear layers train in float8"]
        assert rank["float8 weights"] == (MOE_LINEARS if recipe == "tensorwise" else 0)  # FSDP over dp_shard
        # losses bitwise but one last bit at step 4 (rowwise), first gradients 1.2e-7 apart, parameters 2e-6
        # (measured: AdamW divides by the root of tiny second moments, which amplifies the last bits)
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=0, atol=1e-6)
        differences = gradient_differences(rank["grads"], reference["grads"])
        assert max(differences.values()) < 1e-6, differences
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param, rtol=0, atol=1e-5, msg=name)
    # the conversion bites under ep: the fp32 model's first gradients are elsewhere
    differences = gradient_differences(ranks[0]["grads"], full_precision["grads"])
    assert max(differences.values()) > 100 * GRADIENTS, differences


def ep_x_tp_rank() -> dict[str, dict[str, Any]]:
    """Both recipes in one launch of 4 processes: dp_shard=2 x tp=2 with ep=2 carved from them."""
    return {recipe: plan_rank(recipe, {"dp_shard": 2, "tp": 2, "ep": 2}, 2, True) for recipe in RECIPES}


def test_moe_under_ep_x_tp_trains_as_one_process_per_data_rank() -> None:
    """ep=2 x tp=2 (world 4: dp_shard=2 x tp=2, the experts split over ep=2 carved from those 4 ranks, their
    shards over the other 2): each data rank's rows as under ep alone, each tp pair splitting attention and the
    dense layer as under tp alone. So one process running each data rank's rows on their own, the router losses
    counted 1/2 a part (``reference_run(parts=2)``), with tensorwise's whole-tensor scales, or with rowwise
    multiplying per tp shard (``split_like_tp``)."""
    ranks = run_distributed(ep_x_tp_rank, 4, timeout=240)
    for recipe in RECIPES:
        reference = reference_run(recipe, parts=2, moe=True, tp=recipe == "rowwise", steps=1)
        for rank in ranks:
            run = rank[recipe]
            assert run["float8"] == MOE_LINEARS
            assert run["lines"] == [f"fp8 ({recipe}): {MOE_LINEARS} linear layers train in float8"]
            # torchao's float8 styles (tensorwise): the sequence gather moves float8; torch's plain ones fp32
            assert run["float8 inputs"] == (STEPS if recipe == "tensorwise" else 0)
            assert run["float8 weights"] == 0  # FSDP under tp gathers them in their own dtype
            # the first step only: later ones part by flipped float8 roundings and routing choices
            # (assert_first_step_agrees, ROUTING_FLIPS)
            if recipe == "rowwise":  # first loss bitwise, first gradients 2.7e-7 apart (measured)
                assert_first_step_agrees(run, reference)
            else:
                # tensorwise: where the CPU's matmul kernels (AVX-512 / AMX) block the fp32 sums differently per
                # shard, the first loss is 1.2e-5 apart and the first gradients up to 8 % (layer 2's experts the
                # most: the pattern of a flipped routing choice, beyond what float8 roundings do elsewhere); its
                # pieces are held to one process's first step on their own (tp: the test above; ep:
                # test_moe_under_ep_trains_as_one_process_per_data_rank), the first loss here to 1e-4
                assert abs(run["losses"][0] - reference["losses"][0]) <= 1e-4


# ------------------------------------------------------------------------- compiled blocks, full recompute, tp
def compiled_recompute_tp_rank() -> dict[str, dict[str, Any]]:
    """tp=2, tensorwise, 5 steps on the whole batch: the eager plan's run, then the plan's with its blocks compiled
    (aot_eager) under full recompute, the compiled forwards' runs counted."""
    gloo_gathers_float8_as_bytes()
    eager = trained(planned("tensorwise", {"tp": 2})[0], vocab_parallel=True, lr=TP_LR)
    graphs: list[str] = []
    calls: list[int] = []
    with blocks_compiled_on_aot_eager(graphs, calls):
        model, _, lines = planned("tensorwise", {"tp": 2}, activation_checkpointing="full", compile=True)
    run = trained(model, vocab_parallel=True, lr=TP_LR)
    compiled = {
        **run,
        "graphs": graphs,
        "calls": len(calls),
        "lines": lines,
        "float8": len(float8_names(model)),
    }
    return {"eager": eager, "compiled": compiled}


def test_full_recompute_of_compiled_blocks_under_tp_trains_as_one_process() -> None:
    """tp=2, tensorwise, ``activation_checkpointing="full"`` with ``compile=True``: under tp the plan compiles each
    block first and checkpoints around it (``plans/blocks.py`` says why), so backward runs each block's compiled
    forward again, float8 casts and tp's float8 gathers in it. Bitwise the eager tp plan's run; against one
    process (every tensorwise scale the whole tensor's), the first step within fp32's last bits."""
    ranks = run_distributed(compiled_recompute_tp_rank, 2, timeout=240)
    one = reference_run("tensorwise", steps=1)  # compared on its first step
    for rank in ranks:
        run = rank["compiled"]
        assert run["float8"] == LINEARS
        assert run["lines"] == [f"fp8 (tensorwise): {LINEARS} linear layers train in float8"]
        assert len(run["graphs"]) == 1  # the blocks share one graph, with no break
        assert "torch.float8_e4m3fn" in run["graphs"][0]
        # per step each of the 2 blocks runs it in forward and again in backward (the recompute)
        assert run["calls"] == 2 * 2 * STEPS
        assert_equal_runs(run, rank["eager"])
        # one process, the first step: its loss within fp32's last bit at 5.6, its gradients 1.8e-3 apart by norm
        # where AMX matmul kernels block the sums differently per shard (4.2e-7 where they block them alike); later
        # steps part (assert_first_step_agrees)
        assert_first_step_agrees(run, one, gradients=TENSORWISE_TP_GRADIENTS)
    assert ranks[0]["compiled"]["losses"][-1] < 0.95 * ranks[0]["compiled"]["losses"][0]  # it learns
