"""A transformers Qwen3-MoE with its experts split over ``ep`` by its own config's ep plan (our dispatcher, the
model's own router), inside Lightning's loop, alone and with FSDP, HSDP, pipelines and context parallelism, with
an expert no token chooses, against one process running the unmodified model (losses, gradient norms before
clipping, parameters after every step; fp32, 1e-5). All runs share one launch of ``hf_parity_run.py`` (``conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_parity_run import assert_matches_reference


def ep_run(devices: int, **dims: Any) -> dict[str, Any]:
    # expert 3 of 4 chosen by no token: its rank holds an expert with no rows
    return {"family": "qwen3_moe", "layers": 2, "devices": devices, "dims": dims, "exclude_experts": [3]}


PIPELINE = {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2}
RUNS: dict[str, dict[str, Any]] = {
    "ep2": {**ep_run(2, ep=2), "validate": True},
    "ep2_accumulate2_clip": {**ep_run(2, ep=2), "accumulate": 2, "clip": 3.2},
    "dp_shard4_ep2": ep_run(4, dp_shard=4, ep=2),
    "dp_replicate2_dp_shard2_ep2": ep_run(4, dp_replicate=2, dp_shard=2, ep=2),
    "cp2_ep2": ep_run(2, cp=2, ep=2),
    "pp2_ep2": {**ep_run(4, ep=2, **PIPELINE), "validate": True},
    # the auxiliary-loss-free bias, its loads summed over the ranks routing different tokens (ep, data, tp)
    "ep2_selection_bias": {**ep_run(2, ep=2), "exclude_experts": [], "selection_bias": 0.02},
    "tp2_dp_shard2_selection_bias": {
        **ep_run(4, tp=2, dp_shard=2),
        "exclude_experts": [],
        "selection_bias": 0.02,
    },
    "pp2_selection_bias": {**ep_run(2, **PIPELINE), "exclude_experts": [], "selection_bias": 0.02},
    # GPT-OSS's experts: per-expert biases split with their weights, gate and up interleaved, the clamped SwiGLU
    # (its clamp biting: tiny_hf.FAMILY_FIELDS), its biased router's choice through our dispatcher; with its
    # attention split by heads (sinks with them) at tp=2 and the selection bias choosing for its router
    "gpt_oss_ep2": {"family": "gpt_oss", "layers": 2, "devices": 2, "dims": {"ep": 2}, "validate": True},
    "gpt_oss_tp2_ep2_selection_bias": {
        "family": "gpt_oss",
        "layers": 2,
        "devices": 4,
        "dims": {"tp": 2, "ep": 2},
        "selection_bias": 0.02,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_expert_parallel_matches_one_process(parity_results: dict[str, dict[str, Any]], name: str) -> None:
    run, got = RUNS[name], parity_results[f"{__name__}.{name}"]
    assert ("ep" in got["meshes"]) == ("ep" in run["dims"])  # the experts were split over ep
    assert_matches_reference(run, got)


def test_the_selection_bias_changes_the_routing() -> None:
    """The bias runs above would prove nothing if the bias never changed a choice: the one-process reference
    with it trains otherwise than without it."""
    from tiny_hf import reference_run, tiny_causal_lm

    from lightning_d9d.models.hf import add_selection_bias

    plain = reference_run(tiny_causal_lm("qwen3_moe"), 6)
    biased_model = tiny_causal_lm("qwen3_moe")
    add_selection_bias(biased_model)
    biased = reference_run(biased_model, 6, bias_rate=0.02)
    assert plain["losses"][0] == biased["losses"][0]  # the bias starts at zero
    assert abs(plain["losses"][-1] - biased["losses"][-1]) > 1e-4


# ----------------------------------------------------------------------------------------------------- GPT-OSS
GPT_OSS_IDS = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(7))


def test_gpt_oss_experts_run_ours_with_the_model_s_numbers() -> None:
    """Without ep GPT-OSS's experts run the adapter's forward (local dispatcher, grouped GEMM) wherever its probe
    finds it exact: the model's logits and every gradient, biases included, as ``transformers`` computes them."""
    from tiny_hf import tiny_causal_lm

    from lightning_d9d.mesh import ParallelDims
    from lightning_d9d.models.hf.config_plans import expert_modules
    from lightning_d9d.models.hf.expert import parallelize_hf_experts
    from lightning_d9d.plans.options import ParallelOptions

    reference, model = tiny_causal_lm("gpt_oss"), tiny_causal_lm("gpt_oss")
    changed = parallelize_hf_experts(model, ParallelDims(dp_shard=1).resolve(1), ParallelOptions())
    assert changed == list(expert_modules(model).values()) and all("forward" in vars(e) for e in changed)
    expected, got = (
        reference(input_ids=GPT_OSS_IDS, labels=GPT_OSS_IDS),
        model(input_ids=GPT_OSS_IDS, labels=GPT_OSS_IDS),
    )
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    expected.loss.backward()
    got.loss.backward()
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None and theirs[name].grad is not None, name
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert changed[0].down_proj_bias.grad.abs().min() > 0  # every expert's bias trained: each got tokens


def _gate_with(limit: bool, alpha: bool, interleaved: bool) -> Any:
    """A GPT-OSS gate missing one of its pieces."""

    def apply_gate(self: Any, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
        if limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * (self.alpha if alpha else 1.0))
        return (up + 1) * glu

    return apply_gate


@pytest.mark.parametrize(
    ("limit", "alpha", "interleaved"),
    [(False, True, True), (True, False, True), (True, True, False)],
    ids=["no_clamp", "no_alpha", "halves"],
)
def test_gpt_oss_experts_that_gate_otherwise_are_refused(limit: bool, alpha: bool, interleaved: bool) -> None:
    """The probe tells GPT-OSS's gate from one without its clamp, its gain or its interleave (the same
    parameters, so the layout checks cannot): such experts keep their own forward and are refused under ep."""
    from tiny_hf import tiny_causal_lm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from lightning_d9d.mesh import ParallelDims
    from lightning_d9d.models.hf import check_hf_model

    model = tiny_causal_lm("gpt_oss")
    check_hf_model(model, ParallelDims(ep=2))  # GPT-OSS's own gate: accepted
    otherwise = type(
        "GateOtherwise", (GptOssExperts,), {"_apply_gate": _gate_with(limit, alpha, interleaved)}
    )
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = otherwise
    with pytest.raises(
        NotImplementedError,
        match=r"GateOtherwise\) has a forward that computes otherwise than "
        r"GPT-OSS's clamped SwiGLU",
    ):
        check_hf_model(model, ParallelDims(ep=2))


def test_gpt_oss_router_counts_and_takes_the_selection_bias() -> None:
    """GPT-OSS's router (the top k of its logits, a bias among their terms, and a softmax over the chosen logits)
    is read off its class: it counts its load with the class's own outputs, and under the selection bias chooses by
    ``softmax(logits) + bias`` while its weights stay the softmax over the chosen experts' unbiased logits."""
    from tiny_hf import tiny_causal_lm

    from lightning_d9d.models.hf import add_selection_bias, hf_routers

    reference, model = tiny_causal_lm("gpt_oss"), tiny_causal_lm("gpt_oss")
    add_selection_bias(model)
    routers = list(hf_routers(model).values())
    assert [router._d9d_weighting for router in routers] == ["softmax_of_chosen_logits"] * 2
    expected = reference(input_ids=GPT_OSS_IDS).logits
    assert torch.equal(model(input_ids=GPT_OSS_IDS).logits, expected)  # a zero bias: the class's numbers
    assert all(int(router.expert_load.sum()) == GPT_OSS_IDS.numel() * 2 for router in routers)
    seen: list[tuple[torch.Tensor, ...]] = []
    for router in routers:
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 chosen by every token
        router.register_forward_hook(lambda _module, _args, output: seen.append(output))
    assert not torch.equal(model(input_ids=GPT_OSS_IDS).logits, expected)
    for logits, weights, indices in seen:
        assert bool((indices == 3).any(dim=-1).all())
        assert torch.equal(weights, torch.softmax(logits.gather(1, indices), dim=1))
