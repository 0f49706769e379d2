"""FP8 training through torchao (``D9DStrategy(fp8=...)``, ``plans/fp8.py``) on CPU, where torch emulates float8
matmuls: which linear layers are converted, that FSDP over 2 ranks trains what one process does with the same
conversion, that the conversion bites (the float8 run is not the fp32 one) and that a float8 model learns."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.fp8 import check_fp8, fp8_linear_filter
from lightning_d9d.strategies import D9DStrategy

pytest.importorskip("torchao", reason="torchao is a test dependency (pyproject's test extra)")
STEPS = 5


def float8_names(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))


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
    with pytest.raises(NotImplementedError, match=r"fp8='rowwise' with tp=2: .*use tp=1"):
        D9DStrategy(tp=2, fp8="rowwise")
    assert check_fp8(None, owner="x") is None


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    # a pattern a model can learn within a few steps: each row counts up from a random start
    starts = torch.randint(0, 200, (STEPS, 4, 1), generator=generator)
    tokens = (starts + torch.arange(33)) % 256
    return [(row[:, :-1], row[:, 1:]) for row in tokens]


def train(model: nn.Module, ranks: range, world: int) -> list[float]:
    """5 AdamW steps; each step's batch cut into ``world`` equal parts of which this process runs ``ranks``.

    One process runs both halves one after the other (their gradients summed, each loss halved): float8's
    dynamic scales of the activations are taken over the tensor a matmul sees, so the reference must see each
    rank's half on its own, as the ranks do."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, labels in batches():
        step_loss = torch.zeros(())
        for rank in ranks:
            part = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
            loss = causal_lm_loss(model(inputs[part]), labels[part]) / len(ranks)
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if len(ranks) < world:
            torch.distributed.all_reduce(step_loss)
            step_loss /= world
        losses.append(float(step_loss))
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def fsdp_rank(recipe: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    world = dist.get_world_size()
    model.parallelize(ParallelDims(dp_shard=world).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    losses = train(model, range(dist.get_rank(), dist.get_rank() + 1), world)
    return {"losses": losses, "params": full_parameters(model), "float8": len(float8_names(model))}


def plain_float8_run(recipe: str | None) -> dict[str, Any]:
    """One process, no FSDP, no DTensor: torchao's conversion applied to the blocks by hand."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    if recipe is not None:
        for block in model.model.layers.values():
            convert_to_float8_training(
                block, module_filter_fn=fp8_linear_filter, config=Float8LinearConfig.from_recipe_name(recipe)
            )
    return {"losses": train(model, range(2), 2), "params": full_parameters(model)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_over_two_ranks_trains_the_float8_model_as_one_process(recipe: str) -> None:
    ranks = run_distributed(fsdp_rank, 2, recipe, timeout=240)
    reference = plain_float8_run(recipe)
    full_precision = plain_float8_run(None)
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
