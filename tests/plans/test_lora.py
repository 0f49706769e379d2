"""LoRA's plan on its own: which layers it adapts and refuses, what it freezes, how it starts, and how tensor
parallelism splits an adapter beside its base layer. Training on every degree: ``tests/strategies/test_lora_parity.py``
(our models, through the Trainer) and ``tests/models/hf/test_hf_lora.py`` (a ``transformers`` model)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_d9d import D9DStrategy
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.lora import ExpertsLoRA, LoRALinear
from lightning_d9d.modules.moe import GroupedExperts
from lightning_d9d.plans import parallelize_tensor
from lightning_d9d.plans.lora import LoRA, adapted_layers, apply_lora


def tiny() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config.tiny())


def tiny_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny())  # layers 0 and 2 sparse: 8 experts, hidden 64, ffn 32


EXPERTS = LoRA(rank=4, alpha=8.0, targets=("q_proj",), experts=True)


def test_adapted_model_starts_as_its_base_and_trains_only_the_adapters() -> None:
    model = tiny()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    before = model(ids)
    weight = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    adapted = apply_lora(model, LoRA(rank=4, alpha=8.0), seed=3)
    assert len(adapted) == 2 * 7  # every projection of both layers
    q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, LoRALinear) and q_proj.weight is weight  # the base is shared, not copied
    assert torch.equal(model(ids), before)  # B starts at zero
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{name}.lora_{ab}.weight" for name in adapted for ab in "AB")
    assert (
        q_proj.scaling == 2.0
        and q_proj.lora_A.weight.shape == (4, 64)
        and q_proj.lora_B.weight.shape == (64, 4)
    )
    # A drawn from the seed and its name alone: another model, the same seed, the same adapter
    again = apply_lora(tiny(), LoRA(rank=4, alpha=8.0), seed=3)
    assert torch.equal(
        again["model.layers.1.mlp.down_proj"].lora_A.weight,
        adapted["model.layers.1.mlp.down_proj"].lora_A.weight,
    )
    assert not torch.equal(
        adapted["model.layers.0.mlp.up_proj"].lora_A.weight,
        adapted["model.layers.1.mlp.up_proj"].lora_A.weight,
    )


def test_the_update_is_alpha_over_rank_times_b_a() -> None:
    base = nn.Linear(6, 5)
    layer = LoRALinear.from_linear(base, rank=2, alpha=3.0)
    nn.init.normal_(layer.lora_A.weight)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 6)
    expected = base(x) + 1.5 * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(layer(x), expected)


def test_targets_by_last_name_part_or_whole_name_pattern() -> None:
    only_q = apply_lora(tiny(), LoRA(rank=2, targets="q_proj"), seed=0)
    assert sorted(only_q) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    first_mlp = apply_lora(tiny(), LoRA(rank=2, targets=("model.layers.0.mlp.*_proj",)), seed=0)
    assert sorted(first_mlp) == [f"model.layers.0.mlp.{n}_proj" for n in ("down", "gate", "up")]


def test_frozen_weights_can_be_kept_in_bf16() -> None:
    model = tiny()
    apply_lora(model, LoRA(rank=2, base_dtype=torch.bfloat16), seed=0)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}


def test_stacked_experts_get_per_expert_adapters_with_the_expert_first() -> None:
    model = tiny_moe()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    before = model(ids)
    adapted = apply_lora(model, EXPERTS, seed=3)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    adapter = adapted["model.layers.0.mlp.experts.lora"]
    assert isinstance(adapter, ExpertsLoRA) and experts.lora is adapter
    assert sorted(name for name in adapted if name.endswith(".lora")) == [
        "model.layers.0.mlp.experts.lora",
        "model.layers.2.mlp.experts.lora",  # layer 1 is dense
    ]
    shapes = {n: tuple(p.shape) for n, p in adapter.named_parameters()}
    assert shapes == {  # A [E, r, in], B [E, out, r] per projection
        "lora_A.gate_up_proj": (8, 4, 64),
        "lora_A.down_proj": (8, 4, 32),
        "lora_B.gate_up_proj": (8, 64, 4),
        "lora_B.down_proj": (8, 64, 4),
    }
    assert torch.equal(model(ids), before)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in trainable
    assert trainable == {
        *(f"model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in range(3) for ab in "AB"),
        *(f"model.layers.{i}.mlp.experts.lora.{n}" for i in (0, 2) for n in shapes),
    }
    again = apply_lora(tiny_moe(), EXPERTS, seed=3)["model.layers.0.mlp.experts.lora"]
    assert torch.equal(again.lora_A.get_parameter("down_proj"), adapter.lora_A.get_parameter("down_proj"))


def test_each_expert_gains_its_own_scaled_b_a() -> None:
    """The adapted experts compute what experts whose every matrix is ``W_e + (alpha / r) (B_e A_e)`` (in the
    ``[E, in, out]`` layout: transposed) compute, routing weights included."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 6, 5)
    merged = copy.deepcopy(experts)
    adapter = ExpertsLoRA(experts.stacked_weights(), rank=2, alpha=3.0)
    for param in adapter.parameters():
        nn.init.normal_(param)
    experts.lora = adapter
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            a, b = adapter.lora_A.get_parameter(name), adapter.lora_B.get_parameter(name)
            merged.get_parameter(name).add_(1.5 * torch.bmm(b, a).transpose(1, 2))
    rows, counts, weights = torch.randn(7, 6), torch.tensor([2, 0, 4, 1]), torch.rand(7)
    torch.testing.assert_close(experts(rows, counts, weights), merged(rows, counts, weights))


class _LinearExperts(nn.Module):
    """An MoE whose experts are a ModuleList of nn.Linear: plain linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


@pytest.mark.parametrize(
    ("build", "config", "message"),
    [
        (tiny, LoRA(rank=2, experts=True), r"LoRA\(experts=True\): Qwen3ForCausalLM has no stacked experts"),
        (
            _LinearExperts,
            LoRA(rank=2, targets=("q_proj",), experts=True),
            r"no stacked experts .*; its experts are nn.Linear layers \(experts.0, experts.1, ...\), which "
            "targets adapts by name",
        ),
        (
            tiny_moe,
            LoRA(rank=33, targets=("q_proj",), experts=True),
            r"rank \(33\) exceeds model.layers.0.mlp.experts.down_proj's smaller side \(32 in, 64 out\); "
            r"choose rank <= 32 or use experts=False",
        ),
        (
            tiny_moe,
            LoRA(rank=2, targets=("experts",)),
            r"\(GroupedExperts\), which LoRA cannot adapt.*take theirs with LoRA\(experts=True\)",
        ),
    ],
)
def test_experts_the_plan_cannot_adapt_are_refused_by_name_before_any_change(
    build: type[nn.Module], config: LoRA, message: str
) -> None:
    model = build()
    with pytest.raises(ValueError, match=message):
        apply_lora(model, config, seed=0)
    assert not adapted_layers(model)  # q_proj (which takes rank 33) was not adapted before the refusal


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LoRA(rank=2, targets=("qproj",)), "target 'qproj' matches no module of Qwen3ForCausalLM"),
        (LoRA(rank=65), r"rank \(65\) exceeds model.layers.0.self_attn.q_proj's smaller side"),
        (
            LoRA(rank=2, targets=("self_attn",)),
            r"matches model.layers.0.self_attn \(Attention\), which LoRA cannot",
        ),
        (LoRA(rank=2, targets=("embed_tokens",)), r"\(Embedding\), which LoRA cannot adapt"),
    ],
)
def test_bad_targets_and_ranks_are_refused_by_name(config: LoRA, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_lora(tiny(), config, seed=0)


def test_bad_configs_are_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match="rank must be at least 1"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match="targets is empty"):
        LoRA(targets=())
    with pytest.raises(ValueError, match=r"fp8='tensorwise'.*converts the very linear layers"):
        D9DStrategy(lora=LoRA(), fp8="tensorwise")
    with pytest.raises(TypeError, match=r"takes a lightning_d9d.LoRA, got dict"):
        D9DStrategy(lora={"rank": 4})  # type: ignore[arg-type]


def _split_adapters() -> dict[str, object]:
    """tp=2 over a column-parallel and a row-parallel adapted layer; their placements, local shapes and the output
    against the same two layers on one process (every rank built them alike from one seed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    apply_lora(model, LoRA(rank=4, targets=("0", "1")), seed=0)
    for layer in model:
        nn.init.normal_(layer.lora_B.weight)  # B at zero would hide a wrong split of it
    x = torch.randn(3, 8)
    expected = model(x)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_tensor(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    got = model(x)
    placements = {n: p.placements for n, p in model.named_parameters() if isinstance(p, DTensor)}
    still_frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return {
        "close": torch.allclose(got, expected, atol=1e-6),
        "placements": placements,
        "frozen": (frozen, still_frozen),
    }


def test_tensor_parallelism_splits_each_adapter_beside_its_base_layer() -> None:
    """Column-parallel base (output split): A whole, B's rows split as the base's. Row-parallel base (input split):
    A's columns split as the base's, B whole. The update then has the base output's layout: no extra gather."""
    result = run_distributed(_split_adapters, 2)[0]
    assert result["close"]
    assert result["placements"] == {
        "0.weight": (Shard(0),),
        "0.bias": (Shard(0),),
        "0.lora_A.weight": (Replicate(),),
        "0.lora_B.weight": (Shard(0),),
        "1.weight": (Shard(1),),
        "1.bias": (Replicate(),),
        "1.lora_A.weight": (Shard(1),),
        "1.lora_B.weight": (Replicate(),),
    }
    frozen, still_frozen = result["frozen"]
    assert frozen == still_frozen and len(frozen) == 4
