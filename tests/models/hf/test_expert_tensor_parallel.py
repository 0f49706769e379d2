"""Expert-tensor parallelism (``expert_tensor_parallel=True``: each expert split over tp, the tp group's routed
tokens gathered before the experts and their partial outputs reduce-scattered after) against one process, fp32 on
gloo: our Qwen3-MoE and ``transformers``' Qwen3-MoE, Mixtral and DeepSeek-V3 at tp=2, and our Qwen3-MoE at
tp=2 x dp_shard=2 and at pp=2 x tp=2, each trained ``SHAPE.steps`` AdamW steps by ``layout_runs.train_layout`` (the
strategy's pieces around the plans); the per-step losses and gradient norms and the parameters after the last
step against the one-process run's. Three launches in all: the references on one rank, the tp=2 runs (with the
checkpoint, export and initialisation checks) on two, the four-rank runs on four.

Each piece was seen failing these runs when broken: the partial outputs not reduce-scattered (each rank keeping its
own rows of its partial sum), the fused gate/up weight split on its columns as a plain ``Shard`` (rank 0 all of the
gate, rank 1 all of the up), the tokens not gathered (each rank's own tokens through its shards only).

The checkpoint round trips: a model and its AdamW state saved at tp=2 with the experts split (their gate/up weight a
strided shard, written box by box: ``lightning_d9d/state/boxes.py``) load into the same model at tp=1 (FSDP over
the two ranks) and back, every parameter and moment whole and equal; its Hugging Face export reads back into
either layout, and ``transformers``' ``from_pretrained`` reads its experts whole. Built on ``meta`` with its experts
split, a model initialises from the seed as one process does.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from layout_runs import OURS, Layout, Shape, differences, start_model, start_parameters, train_layouts
from tiny_hf import META_SEED, meta_initialised, tiny_causal_lm, tiny_model
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from lightning_d9d.compat import strided_shard_type
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import check_hf_model, parallelize_hf
from lightning_d9d.models.hf.config_plans import expert_modules
from lightning_d9d.modules.hf_init import init_transformers_model_
from lightning_d9d.modules.moe import GroupedExperts
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.state.hf import load_hf, save_hf
from lightning_d9d.state.training import load, optimizer_state, save

SHAPE = Shape(
    steps=4
)  # tiny_hf's tiny models: 2 layers, hidden 64, 4 experts of width 32 (Mixtral: 128), top-2
# DeepSeek-V3: a dense layer, then an MoE layer with a shared expert beside the routed ones (run on each rank's own
# tokens, added after the reduce-scatter)
FAMILIES = ("ours_qwen3_moe", "qwen3_moe", "mixtral", "deepseek_v3")
TP2 = {family: Layout(family, 2, {"tp": 2}, expert_tensor_parallel=True) for family in FAMILIES}
FOUR_RANKS = {
    "tp2_dp_shard2": Layout("ours_qwen3_moe", 4, {"tp": 2, "dp_shard": 2}, expert_tensor_parallel=True),
    # each pipeline stage (one decoder layer) splits its own experts over tp
    "pp2_tp2": Layout("ours_qwen3_moe", 4, {"pp": 2, "tp": 2}, expert_tensor_parallel=True),
}
# fp32 on the same batches: the layouts differ from one process in the order of their sums only
BAND = {"loss": 1e-5, "norm": 1e-5}
PARAMETER_TOLERANCE = 1e-5


# --------------------------------------------------------------------------------------------- the ranks
def _experts_of(model: nn.Module) -> list[nn.Module]:
    ours = [module for module in model.modules() if isinstance(module, GroupedExperts)]
    return ours or list(expert_modules(model).values())


def _parallel(family: str, dims: dict[str, int], etp: bool) -> tuple[nn.Module, ParallelDims]:
    model = start_model(Layout(family), SHAPE)
    parallel = ParallelDims(**dims).resolve(dist.get_world_size()).build_mesh("cpu")
    options = ParallelOptions(expert_tensor_parallel=etp)
    if family == "ours_qwen3_moe":
        model.parallelize(parallel, options)  # type: ignore[operator]
    else:
        parallelize_hf(model, parallel, options)
    return model, parallel


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    """An AdamW state that differs element by element: one step on gradients equal to the parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for param in model.parameters():
        param.grad = param.detach().clone()
    optimizer.step()
    return optimizer


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _whole_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name."""
    return {name: _whole(param) for name, param in model.named_parameters()}


def _whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW moments, whole, by name."""
    found = _whole_parameters(model)
    for name, param in model.named_parameters():
        found.update(
            {f"{name}.{key}": _whole(optimizer.state[param][key]) for key in ("exp_avg", "exp_avg_sq")}
        )
    return found


def _round_trip(directory: str, family: str, source: dict[str, Any], target: dict[str, Any]) -> bool:
    """Save ``family`` in layout ``source`` (stepped once), load it into a fresh model in layout ``target``; every
    parameter and moment whole must come back equal (also where the source's differ from the fresh model's)."""
    model, _ = _parallel(family, **source)
    optimizer = _stepped(model)
    expected = _whole_state(model, optimizer)
    path = Path(directory) / f"{family}-{'-'.join(map(str, source.values()))}"
    save(
        path,
        {"state_dict": get_model_state_dict(model), "optimizer_states": [optimizer_state(model, optimizer)]},
    )
    other, _ = _parallel(family, **target)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.01)
    load(path, other, {0: other_optimizer}, strict=True, weights_only=True)
    got = _whole_state(other, other_optimizer)
    return got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in expected)


def _hf_round_trip(directory: str, family: str) -> dict[str, bool]:
    """``family`` with its experts split (stepped once) exported in Hugging Face format, then read back into the
    split layout and into FSDP alone: every parameter whole as exported. ``transformers``' own ``from_pretrained``
    (rank 0) reads the export's experts as the split model's whole ones."""
    model, _ = _parallel(family, {"tp": 2}, etp=True)
    _stepped(model)  # every parameter moved from the fresh models' start
    expected = _whole_parameters(model)
    path = Path(directory) / f"{family}-hf"
    save_hf(model, path)
    found = {}
    for name, layout in {"into_etp": ({"tp": 2}, True), "into_tp1": ({"dp_shard": 2}, False)}.items():
        other, _ = _parallel(family, *layout)
        load_hf(other, path)
        got = _whole_parameters(other)
        found[name] = got.keys() == expected.keys() and all(
            torch.equal(got[k], v) for k, v in expected.items()
        )
    if dist.get_rank() == 0 and family != "ours_qwen3_moe":
        import transformers

        loaded = dict(transformers.AutoModelForCausalLM.from_pretrained(path).named_parameters())
        experts = [name for name in expected if ".experts." in name]
        found["from_pretrained"] = bool(experts) and all(
            torch.equal(loaded[name].detach(), expected[name]) for name in experts
        )
    return found


def _meta_initialised(family: str) -> bool:
    """``family`` built on ``meta``, its experts split over tp=2, given memory and initialised from the seed (as the
    strategy does for a model too large for one rank): every parameter whole as one process initialises it."""
    with torch.device("meta"):
        model = (
            start_model(Layout(family), SHAPE) if family in OURS else tiny_model(family, layers=SHAPE.layers)
        )
    dims = ParallelDims(tp=2).resolve(dist.get_world_size()).build_mesh("cpu")
    options = ParallelOptions(expert_tensor_parallel=True)
    if family in OURS:
        model.parallelize(dims, options)  # type: ignore[operator]
    else:
        parallelize_hf(model, dims, options)
    model.to_empty(device="cpu")
    if family in OURS:
        model.init_weights(seed=META_SEED)  # type: ignore[operator]
        expected = start_parameters(Layout(family), SHAPE)
    else:
        init_transformers_model_(model, META_SEED)
        expected = meta_initialised(family, layers=SHAPE.layers)
    got = _whole_parameters(model)
    return got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def _expert_layouts(family: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Each expert weight's placement on the tp mesh dim and its local shape, for the ETP layout at tp=2."""
    model, _ = _parallel(family, {"tp": 2}, etp=True)
    found = []
    for name, param in _experts_of(model)[0].named_parameters():
        assert isinstance(param, DTensor)
        on_tp = param.placements[list(param.device_mesh.mesh_dim_names or ()).index("tp")]
        found.append((name, str(on_tp), tuple(param.to_local().shape)))
    return found


def _two_ranks(directory: str) -> dict[str, Any] | None:
    results = train_layouts([(family, layout, SHAPE) for family, layout in TP2.items()], "fp32")
    etp, fsdp = {"dims": {"tp": 2}, "etp": True}, {"dims": {"dp_shard": 2}, "etp": False}
    checks = {
        "layouts": {family: _expert_layouts(family) for family in ("ours_qwen3_moe", "qwen3_moe")},
        "etp_to_tp1": _round_trip(directory, "ours_qwen3_moe", etp, fsdp),
        "tp1_to_etp": _round_trip(directory, "ours_qwen3_moe", fsdp, etp),
        "hf_etp_to_tp1": _round_trip(directory, "qwen3_moe", etp, fsdp),
        "export": {family: _hf_round_trip(directory, family) for family in ("ours_qwen3_moe", "qwen3_moe")},
        "meta": {family: _meta_initialised(family) for family in ("ours_qwen3_moe", "qwen3_moe")},
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, checks)
    return {"runs": results, "checks": gathered} if dist.get_rank() == 0 else None


# ------------------------------------------------------------------------------------------- the launches
@functools.cache
def references() -> dict[str, Any]:
    (result,) = run_distributed(
        train_layouts, 1, [(family, Layout(family), SHAPE) for family in FAMILIES], "fp32", timeout=300
    )
    return result


@functools.cache
def two_ranks() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_two_ranks, 2, directory, timeout=120)[0]


def assert_matches_one_process(name: str, got: Any, family: str) -> None:
    assert not isinstance(got, str), got  # a rank's traceback
    reference = references()[family]
    assert not isinstance(reference, str), reference
    errors = differences(got, reference, start_parameters(Layout(family), SHAPE))
    largest = max(
        float((got["params"][key] - value).abs().max()) for key, value in reference["params"].items()
    )
    print(name, {key: f"{value:.3g}" for key, value in errors.items()}, f"parameters {largest:.3g}")
    assert errors["steps"] == SHAPE.steps and errors["moved"] > 1e-1  # the steps moved the parameters
    for key, band in BAND.items():
        assert errors[key] <= band, (key, errors)
    assert largest <= PARAMETER_TOLERANCE, largest
    # every rank's experts ran through the tp gather and reduce-scatter
    assert all(facts["dispatchers"] == ["ExpertTensorParallelDispatcher"] for facts in got["facts"]), got[
        "facts"
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_with_experts_split_over_tp_trains_as_one_process(family: str) -> None:
    assert_matches_one_process(f"tp2 {family}", two_ranks()["runs"][family], family)


@functools.cache
def four_ranks() -> dict[str, Any]:
    runs = [(name, layout, SHAPE) for name, layout in FOUR_RANKS.items()]
    return run_distributed(train_layouts, 4, runs, "fp32", timeout=120)[0]


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks_with_experts_split_over_tp_train_as_one_process(name: str) -> None:
    assert_matches_one_process(f"{name} ours_qwen3_moe", four_ranks()[name], FOUR_RANKS[name].family)


def test_each_tp_rank_holds_its_half_of_every_expert() -> None:
    """The gate/up weight a strided shard (each rank its half of the gate, then of the up), the down weight split
    on its ffn dim: half of every expert per rank, in our layout ([E, in, out]) and transformers' ([E, out, in])."""
    strided = str(strided_shard_type()(2, split_factor=2))
    for rank in two_ranks()["checks"]:
        assert rank["layouts"]["ours_qwen3_moe"] == [
            ("gate_up_proj", strided, (4, 64, 32)),  # 4 experts, hidden 64, 2 x 32 / 2
            ("down_proj", str(Shard(1)), (4, 16, 64)),
        ]
        assert rank["layouts"]["qwen3_moe"] == [
            ("gate_up_proj", str(strided_shard_type()(1, split_factor=2)), (4, 32, 64)),
            ("down_proj", str(Shard(2)), (4, 64, 16)),
        ]


@pytest.mark.parametrize("check", ["etp_to_tp1", "tp1_to_etp", "hf_etp_to_tp1"])
def test_a_checkpoint_of_split_experts_loads_into_whole_ones_and_back(check: str) -> None:
    assert all(rank[check] for rank in two_ranks()["checks"])


@pytest.mark.parametrize("family", ["ours_qwen3_moe", "qwen3_moe"])
def test_the_hugging_face_export_of_split_experts_holds_them_whole(family: str) -> None:
    ranks = [rank["export"][family] for rank in two_ranks()["checks"]]
    assert all(rank == {**rank, "into_etp": True, "into_tp1": True} for rank in ranks), ranks
    if family != "ours_qwen3_moe":
        assert ranks[0]["from_pretrained"], ranks[0]


def test_the_adapter_refuses_what_it_cannot_split_before_any_collective() -> None:
    """GPT-OSS's biases come after the down projection (a partial sum under the split); an expert width tp does
    not divide; a dense model has no experts to split. Checked from the model and the degrees alone."""
    dims, options = ParallelDims(tp=2), ParallelOptions(expert_tensor_parallel=True)
    check_hf_model(tiny_causal_lm("qwen3_moe"), dims, options)
    check_hf_model(tiny_causal_lm("mixtral"), dims, options)
    with pytest.raises(
        NotImplementedError,
        match=r"GptOssForCausalLM: expert_tensor_parallel=True, tp=2: model.layers.0.mlp.experts \(GptOssExperts\) "
        r"holds .*only transformers' stacked experts .* take expert-tensor parallelism",
    ):
        check_hf_model(tiny_causal_lm("gpt_oss"), dims, options)
    with pytest.raises(ValueError, match=r"tp \(2\) must divide the experts' width \(33\)"):
        check_hf_model(tiny_causal_lm("qwen3_moe", moe_intermediate_size=33), dims, options)
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM: expert_tensor_parallel=True splits MoE experts"):
        check_hf_model(tiny_causal_lm("qwen3"), dims, options)
    check_hf_model(tiny_causal_lm("qwen3"), dims, ParallelOptions())  # off: nothing to refuse


@pytest.mark.parametrize("family", ["ours_qwen3_moe", "qwen3_moe"])
def test_split_experts_built_on_meta_initialise_as_one_process(family: str) -> None:
    assert all(rank["meta"][family] for rank in two_ranks()["checks"])
