"""FP8 training through torchao (``D9DStrategy(fp8=...)``, ``plans/fp8.py``) on CPU, where torch emulates float8
matmuls: which linear layers are converted, that FSDP over 2 ranks trains what one process does with the same
conversion, that tp over 2 ranks (torchao's float8 styles) does too, that rowwise under tp (torch's plain styles)
scales per tp shard where tp splits a contraction and trains as one process multiplying per shard, that the
conversion bites (the float8 run is not the fp32 one) and that a float8 model learns."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest
import torch
from distributed import run_distributed
from float8_training import (
    STEPS,
    TENSORWISE_TP_GRADIENTS,
    assert_first_step_agrees,
    float8_names,
    full_parameters,
    gloo_gathers_float8_as_bytes,
    split_forward,
    train,
    trained,
)
from fp8_runs import TP_LR, converted_by_hand, first_attention_input, reference_run, split_like_tp
from torch import nn

from lightning_d9d.kernels.grouped_gemm_fp8 import FLOAT8_BACKEND
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.moe import GroupedExperts
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.fp8 import (
    check_fp8,
    check_fp8_device,
    choose_fp8_experts,
    convert_experts_to_float8,
    fp8_experts_blocker,
    fp8_linear_filter,
)
from lightning_d9d.strategies import D9DStrategy

pytest.importorskip("torchao", reason="torchao is a test dependency (pyproject's test extra)")


def conversion_rank(kind: str) -> list[str]:
    torch.manual_seed(0)
    if kind == "moe":  # layer 0 dense, layers 1-2 sparse: grouped experts and the router are no nn.Linear
        model: nn.Module = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(mlp_only_layers=[0]))
    else:
        model = Qwen3ForCausalLM(Qwen3Config.tiny())
    model.parallelize(ParallelDims(dp_shard=1).build_mesh("cpu"), ParallelOptions(fp8="tensorwise"))  # type: ignore[operator]
    return float8_names(model)


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_the_blocks_linear_layers_are_converted_not_the_embedding_head_or_router(kind: str) -> None:
    (names,) = run_distributed(conversion_rank, 1, kind, timeout=120)
    attention = [f"self_attn.{p}_proj" for p in "qkvo"]
    mlp = [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    layers = range(2) if kind == "qwen3" else range(3)
    expected = sorted(
        f"model.layers.{i}.{name}"
        for i in layers
        for name in attention + (mlp if i == 0 or kind == "qwen3" else [])
    )
    assert names == expected


def test_the_default_filter_skips_routers_and_sizes_float8_cannot_multiply() -> None:
    assert fp8_linear_filter(nn.Linear(64, 128), "mlp.up_proj")
    assert not fp8_linear_filter(nn.Linear(64, 8), "mlp.gate")  # a transformers MoE router
    assert not fp8_linear_filter(nn.Linear(64, 130), "mlp.up_proj")  # 130 is no multiple of 16
    assert not fp8_linear_filter(nn.LayerNorm(64), "norm")


def test_bad_fp8_settings_are_refused_before_any_process_group() -> None:
    with pytest.raises(ValueError, match=r"fp8='e4m3'; choose one of 'tensorwise', 'rowwise', or None"):
        D9DStrategy(fp8="e4m3")
    D9DStrategy(tp=2, fp8="tensorwise")  # composes (test_tp_over_two_ranks_...)
    D9DStrategy(tp=2, fp8="rowwise")  # composes, scales per tp shard (test_tp_rowwise_...)
    assert check_fp8(None, owner="x") is None


def fsdp_rank(recipe: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    world = dist.get_world_size()
    model.parallelize(ParallelDims(dp_shard=world).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    losses = train(model, range(dist.get_rank(), dist.get_rank() + 1), world)
    return {"losses": losses, "params": full_parameters(model), "float8": len(float8_names(model))}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_over_two_ranks_trains_the_float8_model_as_one_process(recipe: str) -> None:
    ranks = run_distributed(fsdp_rank, 2, recipe, timeout=240)
    reference = reference_run(recipe, parts=2, lr=1e-2)
    full_precision = reference_run(None, parts=2, lr=1e-2)
    assert ranks[0]["float8"] == 14  # 7 linear layers in each of the 2 blocks
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param, rtol=1e-5, atol=1e-5, msg=name)
    # the conversion bites: float8 rounding moves the losses off the fp32 run's, and the float8 model learns
    print(f"{recipe}: float8 losses {reference['losses']}, fp32 {full_precision['losses']}")
    assert (
        max(abs(a - b) for a, b in zip(reference["losses"][1:], full_precision["losses"][1:], strict=True))
        > 1e-4
    )
    assert reference["losses"][-1] < 0.9 * reference["losses"][0]  # 5.56 -> 4.89 (tensorwise), 4.85 (rowwise)


def tp_rank(recipe: str | None) -> dict[str, Any]:
    """tp=2 (sequence- and loss-parallel; torchao's float8 styles for tensorwise): both ranks see the whole batch,
    as tp ranks do."""
    gloo_gathers_float8_as_bytes()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    model.parallelize(ParallelDims(tp=2).resolve(2).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    seen = first_attention_input(model)
    run = trained(model, vocab_parallel=True, lr=TP_LR)
    return {**run, "float8": len(float8_names(model)), **seen}


def whole_batch_run(recipe: str | None, steps: int = STEPS) -> dict[str, Any]:
    """One process, no DTensor, the whole batch at once (what each tp rank sees): torchao's conversion by hand."""
    model = converted_by_hand(recipe)
    seen = first_attention_input(model)
    return {**trained(model, lr=TP_LR, steps=steps), **seen}


def test_tp_over_two_ranks_trains_the_float8_model_as_one_process() -> None:
    """Under torchao's float8 tp styles every dynamic scale is the amax of the whole (DTensor) tensor, so one
    process seeing the whole batch is the reference, without the per-rank split the FSDP test needs."""
    from torchao.float8.float8_utils import amax_to_scale

    ranks = run_distributed(tp_rank, 2, "tensorwise", timeout=240)
    reference = whole_batch_run("tensorwise", steps=1)  # compared on its first step
    plain_tp = run_distributed(tp_rank, 2, None, timeout=240)[0]
    # the scale of layer 0's gathered input is bitwise one process's: the amax was taken over both shards
    expected_scale = float(amax_to_scale(torch.tensor(reference["amax"]), torch.float8_e4m3fn))
    for rank in ranks:
        assert rank["float8"] == 14  # 7 linear layers in each of the 2 blocks
        assert rank["float8 inputs"] == STEPS  # the sequence gather moved float8 (PrepareFloat8ModuleInput)
        assert rank["scale"] == expected_scale
        # the first step: its loss within fp32's last bit at 5.6, its gradients 1.8e-3 apart by norm (measured
        # on the AMX CPU); later steps part by flipped float8 roundings (assert_first_step_agrees says why)
        assert_first_step_agrees(rank, reference, gradients=TENSORWISE_TP_GRADIENTS)
    # the float8 styles bite: the fp32 tp run gathers no float8 and its losses are not the float8 ones
    assert plain_tp["float8 inputs"] == 0 and plain_tp["float8"] == 0
    print(f"tp float8 losses {ranks[0]['losses']}, fp32 {plain_tp['losses']}")
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], plain_tp["losses"], strict=True)) > 1e-4
    assert ranks[0]["losses"][-1] < 0.95 * ranks[0]["losses"][0]  # 5.56 -> 5.14: it learns


LINEAR_SHAPE = (8, 64, 96)  # tokens, input features, output features


def rowwise_linear_products(style: str | None, *, per_shard: str | None = None) -> dict[str, torch.Tensor]:
    """One rowwise ``Float8Linear`` on fixed data whose magnitudes grow along every dim (so a shard's amax is not
    the whole's): its output, grad_input and grad_weight. ``style``: split over 2 ranks by torch's plain
    ``ColwiseParallel`` (``"column"``) or ``RowwiseParallel`` (``"row"``), the products gathered whole; ``None``:
    one process, where ``per_shard`` (``"column"``, ``"row"``) multiplies as :func:`split_forward` does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    tokens, k, n = LINEAR_SHAPE
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, k, generator=generator) * torch.linspace(0.1, 3, k)
    weight = torch.randn(n, k, generator=generator) * torch.linspace(0.1, 3, k)
    grad_output = torch.randn(tokens, n, generator=generator) * torch.linspace(0.1, 3, n)
    holder = nn.Sequential(nn.Linear(k, n, bias=False))
    with torch.no_grad():
        holder[0].weight.copy_(weight)
    convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name("rowwise"))

    def gathered(local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)

    if style is not None:
        rank = torch.distributed.get_rank()
        split = ColwiseParallel() if style == "column" else RowwiseParallel()
        parallelize_module(holder, init_device_mesh("cpu", (2,)), {"0": split})
        if style == "column":  # the output features are this rank's half, the input whole
            grad_output = grad_output.chunk(2, dim=-1)[rank]
        else:  # the input features are this rank's half
            x = x.chunk(2, dim=-1)[rank]
    elif per_shard is not None:
        split_forward(holder[0], column=per_shard == "column")
    x = x.clone().requires_grad_()
    output = holder(x)
    output.backward(grad_output)
    grad_weight = holder[0].weight.grad
    assert x.grad is not None and grad_weight is not None
    return {
        "output": gathered(output.detach()) if style == "column" else output.detach(),
        "grad_input": gathered(x.grad) if style == "row" else x.grad,  # column: summed over tp by the style
        "grad_weight": grad_weight.full_tensor() if style is not None else grad_weight,
    }


def plain_styles_products() -> dict[str, dict[str, torch.Tensor]]:
    return {style: rowwise_linear_products(style) for style in ("column", "row")}


def test_rowwise_under_plain_tp_styles_scales_each_shard_of_a_split_contraction() -> None:
    """Why rowwise under tp is not one process's float8: a rowwise scale is one per row along the contraction
    dim, and tp splits a contraction in two of a linear's six float8 operands' products. Column-parallel: the
    output (over the whole input features) and grad_weight (over the tokens) are one process's bitwise, but
    grad_input contracts over the output features, which tp splits, so grad_output and the weight are scaled per
    half. Row-parallel: the output contracts over the split input features (the input and weight scaled per
    half); grad_input (over the whole output features) and grad_weight are one process's. Each split product is,
    bitwise, the sum of per-half float8 products (:func:`split_forward`)."""
    (ranks, _) = run_distributed(plain_styles_products, 2, timeout=120)
    whole = rowwise_linear_products(None)
    split_contraction = {"column": "grad_input", "row": "output"}

    def off_by(got: torch.Tensor, expected: torch.Tensor) -> float:
        """The largest difference, as a fraction of the largest element."""
        return float((got - expected).abs().max() / expected.abs().max())

    for style, split in split_contraction.items():
        per_shard = rowwise_linear_products(None, per_shard=style)
        for key, expected in whole.items():
            # the same float8 operands: only the fp32 matmul's summation order may differ (3e-5 measured, in
            # the column-parallel grad_input of rank 0, whose sums of 48 products cancel from ~4e3 down to ~1e2)
            assert off_by(ranks[style][key], per_shard[key]) < 1e-4, (style, key)
            if key == split:  # per-half scales: 3e-3 measured, one float8 step being 6 % of an element
                assert off_by(ranks[style][key], expected) > 1e-3, (style, key)
            else:
                assert torch.equal(ranks[style][key], expected), (style, key)


def test_tp_rowwise_trains_as_one_process_with_per_shard_scales() -> None:
    """tp=2 with rowwise float8 linears under torch's plain styles trains what one process does when each of its
    float8 linears multiplies per tp shard (the test above: scales per shard of a split contraction), and not
    what the plain one-process rowwise model does."""
    ranks = run_distributed(tp_rank, 2, "rowwise", timeout=240)
    model = split_like_tp(converted_by_hand("rowwise"))
    per_shard = {"losses": train(model, range(1), 1, lr=TP_LR), "params": full_parameters(model)}
    whole = whole_batch_run("rowwise")
    for rank in ranks:
        assert rank["float8"] == 14
        assert rank["float8 inputs"] == 0  # torch's plain styles: the sequence gather moves fp32, not float8
        # losses: 2 fp32 last bits at 5.6 measured (9.5e-7; step 0 bitwise); parameters: 1.3e-6 measured, the
        # tolerance the tensorwise test's (one flipped float8 rounding's AdamW step)
        torch.testing.assert_close(rank["losses"], per_shard["losses"], rtol=0, atol=2e-6)
        for name, param in per_shard["params"].items():
            torch.testing.assert_close(rank["params"][name], param, rtol=0, atol=TP_LR / 4, msg=name)
    # the per-shard scales matter: the whole-scale model is 1.2e-5 off at step 0 and 6e-3 in the parameters
    assert abs(ranks[0]["losses"][0] - whole["losses"][0]) > 5e-6
    assert max(float((ranks[0]["params"][n] - p).abs().max()) for n, p in whole["params"].items()) > TP_LR
    assert ranks[0]["losses"][-1] < 0.95 * ranks[0]["losses"][0]  # 5.56 -> 5.14: it learns


# ------------------------------------------------------------------------------- grouped experts in float8
def moe_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())  # layers 0 and 2 sparse: hidden 64, expert width 32
    return list(model.model.layers.values())


def expert_backends(blocks: list[nn.Module]) -> list[str | None]:
    return [m.gemm_backend for block in blocks for m in block.modules() if isinstance(m, GroupedExperts)]


HOPPER = {"device_type": "cuda", "capability": (9, 0), "torchao_moe": True}


@pytest.mark.parametrize(
    ("where", "blocked_by"),
    [
        (HOPPER, None),
        ({**HOPPER, "capability": (10, 0)}, None),
        ({**HOPPER, "device_type": "cpu", "capability": None}, "'cpu'"),
        ({**HOPPER, "capability": (8, 9)}, "9.0 .* this GPU has 8.9"),
        ({**HOPPER, "capability": None}, "has unknown"),
        ({**HOPPER, "torchao_moe": False}, "moe_training"),
    ],
)
def test_the_experts_float8_decision(where: dict[str, Any], blocked_by: str | None) -> None:
    """Pure: where the float8 grouped GEMM can run, and what each ``fp8_experts`` setting then does."""
    blocker = fp8_experts_blocker(**where)
    assert (blocker is None) == (blocked_by is None)
    if blocker is not None:
        assert re.search(str(blocked_by), blocker), blocker
    for recipe in ("rowwise", "tensorwise"):  # the experts take rowwise under either (torchao's only)
        assert not choose_fp8_experts(recipe, False, blocker)
        assert choose_fp8_experts(recipe, None, blocker) == (blocker is None)
        if blocker is None:
            assert choose_fp8_experts(recipe, True, blocker)
        else:
            with pytest.raises(ValueError, match="fp8_experts=True: "):
                choose_fp8_experts(recipe, True, blocker)
    assert not choose_fp8_experts(None, None, None)


def test_the_plan_names_the_float8_backend_where_it_runs(caplog: pytest.LogCaptureFixture) -> None:
    """A Hopper device (given, on this CPU) gets the float8 backend on every grouped experts; a CPU keeps them in
    bf16 with one log line, however often the plan converts (a model's plan, then parallelize_blocks)."""
    blocks = moe_blocks()
    assert convert_experts_to_float8(blocks, "rowwise", None, device_type="cuda", capability=(9, 0)) == 2
    assert expert_backends(blocks) == [FLOAT8_BACKEND] * 2
    assert convert_experts_to_float8(blocks, "rowwise", False, device_type="cuda", capability=(9, 0)) == 0

    blocks = moe_blocks()
    with caplog.at_level(logging.INFO, logger="lightning_d9d.plans"):
        for _ in range(2):
            assert convert_experts_to_float8(blocks, "tensorwise", None, device_type="cpu") == 0
    assert expert_backends(blocks) == [None, None]
    lines = [r.getMessage() for r in caplog.records if "grouped experts" in r.getMessage()]
    assert lines == [
        "fp8 (tensorwise): 2 grouped experts stay in bf16: the model runs on 'cpu' and torchao's "
        "float8 grouped GEMM runs on CUDA only"
    ]
    with pytest.raises(ValueError, match="fp8_experts=True: the model runs on 'cpu'"):
        convert_experts_to_float8(blocks, "rowwise", True, device_type="cpu")
    odd = [GroupedExperts(2, 64, 24)]  # an expert width float8 cannot multiply: bf16, or refused when asked
    assert convert_experts_to_float8(odd, "rowwise", None, device_type="cuda", capability=(9, 0)) == 0
    with pytest.raises(ValueError, match=r"expert width \(24\) must be multiples of 16"):
        convert_experts_to_float8(odd, "rowwise", True, device_type="cuda", capability=(9, 0))


def test_fp8_experts_settings_are_refused_before_any_process_group() -> None:
    with pytest.raises(ValueError, match="fp8_experts=True needs fp8="):
        D9DStrategy(fp8_experts=True)
    D9DStrategy(fp8="rowwise", fp8_experts=True)  # the device is checked at launch
    with pytest.raises(ValueError, match="fp8_experts=True on 'cpu'"):
        check_fp8_device("rowwise", tp=1, device_type="cpu", owner="D9DStrategy", fp8_experts=True)
    check_fp8_device("rowwise", tp=1, device_type="cpu", owner="D9DStrategy", fp8_experts=None)


def moe_cpu_rank(recipe: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())
    model.parallelize(ParallelDims(dp_shard=1).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    losses = train(model, range(1), 1)
    return {"losses": losses, "experts": expert_backends(list(model.model.layers.values()))}


def test_a_cpu_run_with_fp8_trains_the_moe_model_with_bf16_experts() -> None:
    """The default (``fp8_experts=None``) never breaks a CPU run: the linears train in float8, the experts as
    they were, and the model learns."""
    (run,) = run_distributed(moe_cpu_rank, 1, "rowwise", timeout=180)
    assert run["experts"] == [None, None]
    losses = run["losses"]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
