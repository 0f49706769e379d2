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
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.lora import ExpertsLoRA, LoRALinear
from lightning_d9d.modules.moe import GroupedExperts
from lightning_d9d.plans import ParallelOptions, parallelize_tensor
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
    with pytest.raises(
        ValueError, match=r"fp8='tensorwise', tp=2\): under tp torchao's float8 styles.*'rowwise'"
    ):
        D9DStrategy(tp=2, lora=LoRA(), fp8="tensorwise")
    D9DStrategy(
        tp=2, lora=LoRA(), fp8="rowwise"
    )  # composes under tp (test_lora_with_rowwise_fp8_under_tp_...)
    with pytest.raises(ValueError, match=r"LoRA\(experts=True\), fp8_experts=None"):
        D9DStrategy(lora=LoRA(experts=True), fp8="rowwise", fp8_experts=None)
    D9DStrategy(lora=LoRA(), fp8="tensorwise")  # composes at tp=1 (below)
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


# ---------------------------------------------------------------------------------------------------- FP8
def test_under_fp8_the_base_multiplies_in_float8_and_the_adapter_in_its_dtype() -> None:
    """An adapted layer under ``fp8``: torchao's ``Float8Linear`` over the same base weight, plus the adapter in
    fp32, computed here by hand: the same output and the same adapter gradients; the base gets none."""
    pytest.importorskip("torchao", reason="FP8 needs torchao (pyproject's test extra)")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from lightning_d9d.plans.fp8 import apply_fp8

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    apply_lora(
        block, LoRA(rank=16, targets=("0",)), seed=0
    )  # rank 16: a size float8 could multiply, kept fp32
    nn.init.normal_(block[0].lora_B.weight)
    base = Float8Linear.from_float(
        copy.deepcopy(nn.Linear(64, 128)), config=Float8LinearConfig.from_recipe_name("tensorwise")
    )
    with torch.no_grad():
        base.weight.copy_(block[0].weight)
        base.bias.copy_(block[0].bias)
    a, b = block[0].lora_A.weight.detach().clone(), block[0].lora_B.weight.detach().clone()
    assert apply_fp8([block], "tensorwise", ParallelDims(), fsdp=False) == 2
    layer = block[0]
    assert isinstance(layer, Float8Linear) and isinstance(layer, LoRALinear) and layer.scaling == 2.0
    assert type(layer.lora_A) is nn.Linear and type(layer.lora_B) is nn.Linear  # the adapter is not float8
    x = torch.randn(8, 64, requires_grad=True)
    expected = base(x) + 2.0 * (x @ a.T) @ b.T
    got = layer(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    got.square().sum().backward()
    assert layer.weight.grad is None and layer.lora_A.weight.grad is not None
    manual_a = a.clone().requires_grad_()
    (base(x.detach()) + 2.0 * (x.detach() @ manual_a.T) @ b.T).square().sum().backward()
    torch.testing.assert_close(layer.lora_A.weight.grad, manual_a.grad, rtol=1e-5, atol=1e-6)


def _fsdp_lora_fp8(world_rank: int | None = None) -> dict[str, object]:
    import torch.distributed as dist
    from float8_training import full_parameters, train

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    apply_lora(model, LoRA(rank=16, alpha=16.0), seed=0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    options = ParallelOptions(fp8="tensorwise", fsdp_on_one_rank=world > 1)
    model.parallelize(ParallelDims(dp_shard=world).build_mesh("cpu"), options)
    ranks = range(2) if world == 1 else range(dist.get_rank(), dist.get_rank() + 1)
    losses = train(model, ranks, 2, eps=1e-4)
    return {"losses": losses, "params": full_parameters(model)}


def test_lora_with_fp8_under_fsdp_trains_as_one_process() -> None:
    """dp_shard=2, tensorwise (weights all-gathered in float8 by FSDP): the adapters train as one process that
    runs each rank's half of the batch on its own (float8 scales are taken over what a matmul sees)."""
    pytest.importorskip("torchao", reason="FP8 needs torchao (pyproject's test extra)")
    ranks = run_distributed(_fsdp_lora_fp8, 2, timeout=240)
    (expected,) = run_distributed(_fsdp_lora_fp8, 1, timeout=240)
    torch.testing.assert_close(ranks[0]["losses"], expected["losses"], rtol=1e-5, atol=1e-5)
    for name, value in expected["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert expected["losses"][-1] < expected["losses"][0]  # the adapters learn


def test_the_tensor_plan_refuses_a_tensorwise_adapted_layer_by_name() -> None:
    """torchao's float8 tp styles cast a layer's input to float8, which its adapter would read: the plan names the
    layer and the recipe that composes (the strategy refuses the same options before any process starts)."""
    pytest.importorskip("torchao", reason="FP8 needs torchao (pyproject's test extra)")
    from lightning_d9d.plans.fp8 import apply_fp8, float8_tensor_plan

    block = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    apply_lora(block, LoRA(rank=4, targets=("0",)), seed=0)
    apply_fp8([block], "tensorwise", ParallelDims(), fsdp=False)
    with pytest.raises(ValueError, match=r"fp8='tensorwise' under tp: 0 is adapted by LoRA.*fp8='rowwise'"):
        float8_tensor_plan(block, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    block = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    apply_lora(block, LoRA(rank=4, targets=("0",)), seed=0)
    apply_fp8([block], "rowwise", ParallelDims(), fsdp=False)
    plan = float8_tensor_plan(block, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert type(plan["0"]) is ColwiseParallel  # rowwise: torch's plain styles, the adapter's input as it is


def _tp_lora_fp8(recipe: str) -> dict[str, object]:
    """tp=2 (sequence- and loss-parallel), the adapted layers' base in float8 under torch's plain styles, the
    adapters split beside it (``lora_tensor_plan``); both ranks see the whole batch, as tp ranks do."""
    from float8_training import float8_names, full_parameters, train
    from fp8_runs import TP_LR

    model = _lora_fp8_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model.parallelize(ParallelDims(tp=2).resolve(2).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    losses = train(model, range(1), 1, vocab_parallel=True, lr=TP_LR)
    return {
        "losses": losses,
        "params": full_parameters(model),
        "float8": len(float8_names(model)),
        "base": base,
    }


def _lora_fp8_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    apply_lora(model, LoRA(rank=4, alpha=8.0), seed=0)
    return model


def _per_tp_shard(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Every adapted float8 layer of the one-process ``model`` multiplies its base per shard of tp=2, as Qwen3's
    tensor plan splits it (``split_forward``: rowwise scales per shard where tp splits a contraction), and adds its
    adapter's update over the whole input, as the split adapter sums it."""
    from float8_training import split_forward
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_d9d.models.qwen3 import tensor_plan

    plan = tensor_plan(model.model, model.lm_head, prefix="model.")
    for name, layer in adapted_layers(model).items():
        split_forward(layer, column=isinstance(plan[name], ColwiseParallel))
        base = layer.forward

        def forward(x: torch.Tensor, layer: LoRALinear = layer, base=base) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return base(x) + layer.lora_B(layer.lora_A(layer.lora_dropout(x))) * layer.scaling

        layer.forward = forward  # type: ignore[method-assign]
    return model


def test_lora_with_rowwise_fp8_under_tp_trains_as_one_process_per_shard() -> None:
    """tp=2, rowwise: the adapted layers' base multiplies in float8 under torch's plain styles (scales per tp shard
    where tp splits a contraction, ``tests/plans/test_fp8.py`` shows why), the adapters in fp32 split as
    ``lora_tensor_plan`` splits them. Against one process with the same conversion (``apply_fp8``'s
    ``Float8LoRALinear``) multiplying per shard, over 5 AdamW steps: the losses within 2 fp32 last bits and the
    adapters within a quarter of lr, the band of the rowwise tp test without LoRA (a last-bit difference of the
    fp32 sums can flip one float8 rounding, and AdamW turns it into a step of about lr on a near-zero gradient);
    the base bit for bit as loaded."""
    pytest.importorskip("torchao", reason="FP8 needs torchao (pyproject's test extra)")
    from float8_training import full_parameters, train
    from fp8_runs import TP_LR

    from lightning_d9d.plans.fp8 import apply_fp8

    ranks = run_distributed(_tp_lora_fp8, 2, "rowwise", timeout=240)
    model = _lora_fp8_model()
    assert apply_fp8(list(model.model.layers.values()), "rowwise", ParallelDims(), fsdp=False) == 14
    _per_tp_shard(model)
    expected = {"losses": train(model, range(1), 1, lr=TP_LR), "params": full_parameters(model)}
    for rank in ranks:
        assert rank["float8"] == 14  # every projection of both blocks: a float8 base with its adapter
        torch.testing.assert_close(rank["losses"], expected["losses"], rtol=0, atol=2e-6)
        adapters = [name for name in expected["params"] if ".lora_" in name]
        assert len(adapters) == 28
        for name in adapters:
            torch.testing.assert_close(rank["params"][name], expected["params"][name], rtol=0, atol=TP_LR / 4)
        for name, value in rank["base"].items():  # frozen: bit for bit the loaded base, on every rank
            assert torch.equal(rank["params"][name], value), name
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]  # the adapters learn
    # measured: the losses within 1 fp32 last bit, the adapters 3.8e-7 apart; the per-shard scales matter: one
    # process scaling whole tensors is 1.2e-5 off in the first loss and 4e-3 in the adapters
    whole = _lora_fp8_model()
    apply_fp8(list(whole.model.layers.values()), "rowwise", ParallelDims(), fsdp=False)
    whole_losses = train(whole, range(1), 1, lr=TP_LR)
    assert abs(ranks[0]["losses"][0] - whole_losses[0]) > 5e-6
    # the adapters moved well beyond the band: B left at zero would pass the comparison trivially
    assert (
        min(float(expected["params"][n].abs().max()) for n in expected["params"] if ".lora_B." in n) > TP_LR
    )
