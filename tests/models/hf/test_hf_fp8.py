"""FP8 training (``fp8=...``, ``plans/fp8.py``) of ``transformers`` models under the adapter, on CPU, where torch
emulates the float8 matmuls: which modules are converted (Qwen3, Llama, Qwen3-MoE, AFMoE, whose router is an
``nn.Linear``); FSDP over 2 ranks on packed rows (the adapter's per-document attention) trains what one process does
running the unmodified model with torchao's conversion applied by hand; tp over 2 ranks trains, with tensorwise
(torchao's float8 styles, the regions' sequence gathers in float8), what one process does seeing the whole batch,
with its scales; with rowwise (torch's plain styles), what one process does multiplying per tp shard; the float8
runs are not the fp32 ones, and they learn. The stacked experts: where the float8 grouped GEMM can run (given here:
this CPU has no Hopper) the adapter's forward takes them to the ``torchao_fp8`` backend; elsewhere they keep
``transformers``' forward with one log line."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from float8_training import (
    STEPS,
    TENSORWISE_TP_GRADIENTS,
    assert_first_step_agrees,
    convert_by_hand,
    float8_names,
    full_parameters,
    gloo_gathers_float8_as_bytes,
    record_attention_input,
    split_forward,
    train,
)
from tiny_hf import tiny_causal_lm
from torch import nn

from lightning_d9d.kernels.grouped_gemm_fp8 import FLOAT8_BACKEND
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.models.hf.expert import offer_experts_to_float8, parallelize_hf_experts
from lightning_d9d.models.hf.tensor import split_modules
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.fp8 import convert_experts_to_float8

pytest.importorskip("torchao", reason="torchao is a test dependency (pyproject's test extra)")

VOCAB = 256  # the count-up batches' ids (float8_training.batches)
# AdamW's eps well above the gradients' float8 noise: with the default 1e-8 Adam steps a near-zero entry by about
# lr * sign(g), so one flipped float8 rounding (a last-bit difference in an fp32 sum before a cast) moves a parameter
# by lr, and such flips compound within 5 steps (measured at tp=2: 1.8e-5 in the third loss, 3.8e-3 in the
# parameters); with 1e-4 the same runs agree to fp32's last bits
EPS = 1e-4
LR = 1e-2
TP_LR = 1e-3  # as tests/plans/fp8_runs.py's TP_LR: flips compound at 1e-2 under tp's split sums
# packed rows: every row holds documents of 5, 11 and 16 tokens, positions restarting at 0 at each
PACKED = torch.cat([torch.arange(n) for n in (5, 11, 16)])


def model_of(family: str, recipe: str | None = None, **overrides: Any) -> nn.Module:
    """The seeded tiny model; with ``recipe`` torchao's own conversion of its decoder layers (the references)."""
    model = tiny_causal_lm(family, vocab_size=VOCAB, **overrides)
    convert_by_hand(model.model.layers, recipe)
    return model


def packed_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows of several documents: the adapter's per-document attention, or transformers' own (no cache)."""
    positions = PACKED.expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def farthest(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((params[name] - value).abs().max()) for name, value in reference.items())


# ------------------------------------------------------------------------------------------- what is converted
def converted_rank() -> dict[str, list[str]]:
    found = {}
    for family in ("qwen3", "llama", "qwen3_moe", "afmoe"):
        # Qwen3-MoE: layer 0 dense, layer 1 sparse (its router and stacked experts are no nn.Linear)
        extra = {"mlp_only_layers": [0]} if family == "qwen3_moe" else {}
        model = model_of(family, **extra)
        parallelize_hf(model, ParallelDims(dp_shard=1).build_mesh("cpu"), ParallelOptions(fp8="tensorwise"))
        found[family] = float8_names(model)
    return found


def test_the_decoder_layers_linears_are_converted_not_the_embedding_head_router_or_experts() -> None:
    (found,) = run_distributed(converted_rank, 1, timeout=120)
    attention = [f"self_attn.{p}_proj" for p in "qkvo"]
    mlp = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
    dense = [f"model.layers.{i}.{name}" for i in range(2) for name in attention + mlp]
    assert found["qwen3"] == sorted(dense)
    assert found["llama"] == sorted(dense)
    # layer 1's MoE block: its router (Qwen3MoeTopKRouter) and experts (3-D parameters) stay as they are
    assert found["qwen3_moe"] == sorted(
        [f"model.layers.0.{name}" for name in attention + mlp]
        + [f"model.layers.1.{name}" for name in attention]
    )
    # AFMoE: its attention's output gate (self_attn.gate_proj) is a projection, its router (mlp.router.gate, an
    # nn.Linear of 16 x 64, a size float8 could multiply) is not converted, its shared expert is
    gated = [*attention, "self_attn.gate_proj"]
    shared = [f"mlp.shared_experts.{p}_proj" for p in ("down", "gate", "up")]
    assert found["afmoe"] == sorted(
        [f"model.layers.0.{name}" for name in gated + mlp]
        + [f"model.layers.1.{name}" for name in gated + shared]
    )


# ------------------------------------------------------------------------------------------------ FSDP
def fsdp_rank(family: str, recipe: str) -> dict[str, Any]:
    model = model_of(family)
    rank, world = dist.get_rank(), dist.get_world_size()
    parallelize_hf(model, ParallelDims(dp_shard=world).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    # tensorwise: torchao's weight wrapper, which FSDP2 asks to cast each shard to float8 before the all-gather
    gathered_in_float8 = sorted(
        name.removesuffix(".weight")
        for name, p in model.named_parameters()
        if type(getattr(p, "_local_tensor", p)).__name__ == "WeightWithDynamicFloat8CastTensor"
    )
    losses = train(model, range(rank, rank + 1), world, lr=LR, eps=EPS, forward=packed_logits)
    return {
        "losses": losses,
        "params": full_parameters(model),
        "float8": float8_names(model),
        "gathered in float8": gathered_in_float8,
    }


@pytest.mark.parametrize(("family", "recipe"), [("qwen3", "tensorwise"), ("qwen3_moe", "rowwise")])
def test_fsdp_over_two_ranks_trains_the_float8_model_on_packed_rows_as_one_process(
    family: str, recipe: str
) -> None:
    """dp_shard=2 (tensorwise: the weights all-gathered in float8) on packed rows against one process running the
    unmodified model, its layers converted by torchao by hand, each rank's half of every batch on its own (float8
    scales the activations over the tensor a matmul sees)."""
    ranks = run_distributed(fsdp_rank, 2, family, recipe, timeout=240)
    model = model_of(family, recipe)
    reference = {
        "losses": train(model, range(2), 2, lr=LR, eps=EPS, forward=packed_logits),
        "params": full_parameters(model),
    }
    full_precision = train(model_of(family), range(2), 2, lr=LR, eps=EPS, forward=packed_logits)
    assert ranks[0]["float8"] == float8_names(model)
    assert ranks[0]["gathered in float8"] == (float8_names(model) if recipe == "tensorwise" else [])
    for rank in ranks:
        # the adapter's document attention and transformers' own agree to fp32's last bits (1e-5 in
        # test_hf_packed.py); here 0 and 2e-7 in the losses, 1e-7 in the parameters, measured
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param, rtol=1e-5, atol=1e-5, msg=name)
    # the conversion bites (the fp32 run is 2e-2 .. 5e-2 away by step 5) and the float8 model learns
    print(f"{family} {recipe}: float8 losses {reference['losses']}, fp32 {full_precision}")
    assert close(reference["losses"][1:], full_precision[1:]) > 1e-3
    assert reference["losses"][-1] < 0.8 * reference["losses"][0]


# ------------------------------------------------------------------------------------------------- tp
# Qwen3-MoE under tp: layer 0 dense (its MLP split as Qwen3's), layer 1 sparse (its MoE block routes each rank's
# sequence shard through whole experts, its router and experts unconverted)
TP_FAMILIES = {"qwen3": {}, "qwen3_moe": {"mlp_only_layers": [0]}}


def tp_rank(recipe: str, family: str = "qwen3") -> dict[str, Any]:
    """tp=2 (sequence- and loss-parallel): both ranks see the whole batch, as tp ranks do."""
    gloo_gathers_float8_as_bytes()
    model = model_of(family, **TP_FAMILIES[family])
    parallelize_hf(model, ParallelDims(tp=2).resolve(2).build_mesh("cpu"), ParallelOptions(fp8=recipe))
    return tp_or_whole_batch_run(model, vocab_parallel=True)


def tp_or_whole_batch_run(model: nn.Module, *, vocab_parallel: bool, steps: int = STEPS) -> dict[str, Any]:
    layer = model.model.layers[0]
    seen = record_attention_input(layer.input_layernorm, layer.self_attn)
    first: dict[str, torch.Tensor] = {}

    def after(step: int) -> None:
        if step == 0:
            first.update(full_parameters(model))

    grads: dict[str, torch.Tensor] = {}
    losses = train(
        model,
        range(1),
        1,
        vocab_parallel=vocab_parallel,
        lr=TP_LR,
        eps=EPS,
        after_step=after,
        first_grads=grads,
        steps=steps,
    )
    return {
        "losses": losses,
        "grads": grads,
        "first step": first,
        "params": full_parameters(model),
        "float8": float8_names(model),
        **seen,
    }


def whole_batch_run(
    recipe: str | None, *, per_shard: bool = False, family: str = "qwen3", steps: int = STEPS
) -> dict[str, Any]:
    """One process, the whole batch at once; ``per_shard``: every float8 linear multiplies per tp shard
    (:func:`split_forward`), column- or row-parallel as the config's tp plan splits it."""
    model = model_of(family, recipe, **TP_FAMILIES[family])
    if per_shard:
        styles = split_modules(model)
        for name in float8_names(model):
            assert styles[name] in ("colwise", "rowwise"), name
            split_forward(model.get_submodule(name), column=styles[name] == "colwise")
    return tp_or_whole_batch_run(model, vocab_parallel=False, steps=steps)


def test_tp_tensorwise_gathers_float8_and_trains_as_one_process_with_its_scales() -> None:
    """Under torchao's float8 styles every dynamic scale is the amax of the whole (DTensor) tensor, so one process
    seeing the whole batch is the reference. The regions' sequence gathers move float8: the attention receives
    torchao's float8 tensor, its scale bitwise one process's (the amax taken over both sequence shards)."""
    from torchao.float8.float8_utils import amax_to_scale

    ranks = run_distributed(tp_rank, 2, "tensorwise", timeout=240)
    reference = whole_batch_run("tensorwise", steps=1)  # compared on its first step
    full_precision = whole_batch_run(None)
    expected_scale = float(amax_to_scale(torch.tensor(reference["amax"]), torch.float8_e4m3fn))
    for rank in ranks:
        assert rank["float8"] == reference["float8"]
        assert rank["float8 inputs"] == STEPS and reference["float8 inputs"] == 0
        assert rank["scale"] == expected_scale
        assert_first_step_agrees(rank, reference, gradients=TENSORWISE_TP_GRADIENTS)
    print(f"tp tensorwise losses {ranks[0]['losses']}, fp32 {full_precision['losses']}")
    assert close(ranks[0]["losses"][1:], full_precision["losses"][1:]) > 1e-3  # 1.1e-2 by step 5
    assert ranks[0]["losses"][-1] < 0.9 * ranks[0]["losses"][0]  # 5.85 -> 5.14: it learns


def test_tp_rowwise_takes_its_first_step_as_one_process_multiplying_per_shard() -> None:
    """Rowwise under torch's plain styles scales each rank's operands over its own shard where tp splits a
    contraction (``plans/fp8.py``; the products proven one by one in ``tests/plans/test_fp8.py``): tp=2 computes
    what one process does when each float8 linear multiplies per shard as the config's tp plan splits it, not what
    the one-process rowwise model does.

    Compared on the first step: rowwise scales are powers of two per row, so a last-bit change of a row's amax
    across a power of two re-rounds the whole row. Measured on this model: scaling every parameter by 1 + 2^-22
    moves step 0's gradients by 10 % of their largest element; tp's other order of fp32 sums moves them by 3e-5
    at step 0, and after the first update the two runs part (1e-2 in step 1's gradients)."""
    ranks = run_distributed(tp_rank, 2, "rowwise", timeout=240)
    per_shard = whole_batch_run("rowwise", per_shard=True)
    whole = whole_batch_run("rowwise")
    for rank in ranks:
        assert rank["float8"] == per_shard["float8"]
        assert rank["float8 inputs"] == 0  # torch's plain styles: the sequence gather moves fp32
        # the first loss and the one after the first update: equal to fp32's last bit (4.8e-7), measured
        torch.testing.assert_close(rank["losses"][:2], per_shard["losses"][:2], rtol=0, atol=2e-6)
        for name, param in per_shard["first step"].items():  # 1e-7 measured
            torch.testing.assert_close(rank["first step"][name], param, rtol=0, atol=1e-6, msg=name)
    # the per-shard scales matter: the one-process rowwise model's first loss is 1.5e-3 off, measured
    assert abs(ranks[0]["losses"][0] - whole["losses"][0]) > 1e-4
    assert farthest(ranks[0]["first step"], whole["first step"]) > 1e-5
    assert ranks[0]["losses"][-1] < 0.9 * ranks[0]["losses"][0]  # 5.83 -> 5.13: it learns


def moe_tp_rank() -> dict[str, dict[str, Any]]:
    """Both recipes in one launch: a transformers Qwen3-MoE at tp=2."""
    return {recipe: tp_rank(recipe, "qwen3_moe") for recipe in ("tensorwise", "rowwise")}


def test_moe_under_tp_trains_as_one_process_with_its_scales() -> None:
    """A transformers Qwen3-MoE at tp=2 (layer 0 dense, layer 1 sparse): attention and the dense MLP are split
    as Qwen3's and train in float8 as they do (tensorwise: torchao's float8 styles, every scale the whole
    tensor's, so one process seeing the whole batch; rowwise: torch's plain styles, one process multiplying per
    tp shard); the MoE block routes each rank's sequence shard through whole experts, router and experts
    unconverted, its gradients summed over tp.

    Held to one process on the first step (``assert_first_step_agrees``): later, the fp32 sums' last bits flip
    float8 roundings that AdamW turns into lr-sized steps, and from there the routers' top-2 choice for a few
    tokens (tensorwise: 6 of 128 at step 3 under one CPU's summation order), which moves the loss by up to 7e-3
    here."""
    ranks = run_distributed(moe_tp_rank, 2, timeout=240)
    for recipe in ("tensorwise", "rowwise"):
        # both compared on their first step
        reference = whole_batch_run(recipe, family="qwen3_moe", per_shard=recipe == "rowwise", steps=1)
        other = whole_batch_run(recipe, family="qwen3_moe", per_shard=recipe != "rowwise", steps=1)
        for rank in ranks:
            run = rank[recipe]
            assert run["float8"] == reference["float8"]
            assert len(run["float8"]) == 11  # q, k, v, o in both layers; gate, up, down in the dense one
            assert run["float8 inputs"] == (STEPS if recipe == "tensorwise" else 0)
            assert_first_step_agrees(run, reference)
        # the scales matter: with the other recipe's reference (per shard for tensorwise, whole tensors for
        # rowwise) the first step's parameters are 2e-3 apart (measured)
        assert farthest(ranks[0][recipe]["first step"], other["first step"]) > 1e-4
        assert (
            ranks[0][recipe]["losses"][-1] < 0.95 * ranks[0][recipe]["losses"][0]
        )  # 5.75 -> 5.14: it learns


# ---------------------------------------------------------------------------------------- stacked experts
def experts_of(model: nn.Module) -> list[nn.Module]:
    return [model.model.layers[i].mlp.experts for i in range(2)]


def test_where_the_float8_grouped_gemm_runs_the_stacked_experts_take_it_through_the_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a Hopper (this CPU is none): the FP8 plan points transformers' stacked experts at the float8 grouped
    GEMM, as it does ours, and the adapter's forward (not transformers' own, which never reaches the registry)
    runs them with it. The backend is swapped here for the registry's choice on the same call, so the forward is
    checked against transformers' on CPU."""
    import lightning_d9d.models.hf.expert as hf_expert

    model, reference = model_of("qwen3_moe"), model_of("qwen3_moe")
    options = ParallelOptions(fp8="rowwise", fp8_experts=None)
    assert offer_experts_to_float8(model, options) == experts_of(model)
    layers = list(model.model.layers)
    assert convert_experts_to_float8(layers, "rowwise", None, device_type="cuda", capability=(9, 0)) == 2
    assert [experts.gemm_backend for experts in experts_of(model)] == [FLOAT8_BACKEND] * 2
    assert parallelize_hf_experts(model, ParallelDims(), options) == experts_of(model)

    backends: list[str | None] = []
    grouped_mm = hf_expert.grouped_mm

    def recorded(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor, backend: str | None = None) -> Any:
        backends.append(backend)
        return grouped_mm(x, w, sizes)

    monkeypatch.setattr(hf_expert, "grouped_mm", recorded)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert backends == [FLOAT8_BACKEND] * 4  # gate/up and down, in both layers


def cpu_experts_rank(fp8_experts: bool | None) -> dict[str, Any]:
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_d9d.plans").addHandler(handler)
    logging.getLogger("lightning_d9d.plans").setLevel(logging.INFO)
    model = model_of("qwen3_moe")
    options = ParallelOptions(fp8="rowwise", fp8_experts=fp8_experts)
    parallelize_hf(model, ParallelDims(dp_shard=1).build_mesh("cpu"), options)
    return {
        "messages": [m for m in messages if "grouped experts" in m],
        "backends": [getattr(experts, "gemm_backend", "absent") for experts in experts_of(model)],
        "ours": ["forward" in vars(experts) for experts in experts_of(model)],
    }


def test_off_hopper_the_stacked_experts_stay_in_bf16_with_one_log_line() -> None:
    # they run the adapter's forward on the registry's grouped GEMM, as every experts module without ep does
    # (test_hf_local_experts.py), not the float8 one
    (auto,) = run_distributed(cpu_experts_rank, 1, None, timeout=120)
    assert auto["messages"] == [
        "fp8 (rowwise): 2 grouped experts stay in bf16: the model runs on 'cpu' and torchao's float8 grouped GEMM "
        "runs on CUDA only"
    ]
    assert auto["backends"] == [None, None] and auto["ours"] == [True, True]
    (off,) = run_distributed(cpu_experts_rank, 1, False, timeout=120)  # the default: not even offered
    assert off == {"messages": [], "backends": ["absent", "absent"], "ours": [True, True]}


def test_fp8_experts_on_experts_the_adapter_cannot_run_are_refused_before_any_collective() -> None:
    model = model_of("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    experts.down_proj_bias = nn.Parameter(torch.zeros(4, 64))  # a family with expert biases
    with pytest.raises(
        ValueError,
        match=r"^fp8_experts=True: Qwen3MoeForCausalLM's model\.layers\.1\.mlp\.experts \(Qwen3MoeExperts\) holds "
        r"\['down_proj', 'down_proj_bias', 'gate_up_proj'\]; .*leave fp8_experts=None",
    ):
        offer_experts_to_float8(model, ParallelOptions(fp8="rowwise", fp8_experts=True))
    # left to the plan (None): those experts keep transformers' forward, the others are offered
    assert offer_experts_to_float8(model, ParallelOptions(fp8="rowwise", fp8_experts=None)) == [
        model.model.layers[0].mlp.experts
    ]
