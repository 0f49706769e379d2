"""Expert parallelism inside Lightning's loop against a single-process loop (fp32, gloo, 1e-5).

Qwen3-MoE (tiny: 8 experts, top-2, sparse layers around a dense one) with the load-balancing and z losses in
the gradient and the auxiliary-loss-free bias update after every optimizer step (``ExpertLoadBalancing``).
Experts 6 and 7 are excluded by their selection bias, so loads are uneven and some experts receive no token
(``moe/.../load_min`` is 0). 5 optimizer steps: losses, parameters, pre-clip gradient norms. Cases: ep=2 (the
experts split over both data ranks), ep=2 inside dp_shard=4 (experts split over 2, each shard FSDP-sharded over
the other 2; 4 processes), ep=2 under HSDP (dp_replicate=2 x dp_shard=2), ep=2 x pp=2 (each pipeline stage's
experts split over its 2 data ranks), Qwen3-MoE on pp=2 without ep, and context parallelism: cp=2 alone (each
rank routes its half of every sequence; the load-balancing loss counts the whole sequences' tokens, the bias
update sums the load over both), and ep=2 x cp=2 x dp_shard=2 (experts split over the 2 cp ranks, which hold
different tokens of the same sequences), and ep=2 x cp=2 x pp=2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer_parity import (
    BASE,
    assert_matches_reference,
    launcher_by_world_size,
)

from lightning_d9d.convert import main as convert
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.state.hf import load_hf

# Router selection bias on (the bias update needs it); the z-loss on beside the load-balancing loss.
MOE = {"router_selection_bias": True, "router_z_loss_coef": 1e-3}
# rate 0.01: large next to the router probabilities (~1/8), so a missing or doubled update changes routing
BALANCE = {"rate": 0.01, "unchosen": [6, 7]}

# SGD with every step's gradients compared (``record_grads``, see test_moe_parallel_runs_are_one_process_up_to_rounding)
# for the ep=2 cases on 2 ranks: under AdamW their embedding rows end up to 6.2e-5 from one process on an AMD EPYC
# (AVX2) while the same code held 1e-5 on the machines before it, every loss within 1e-6: AdamW's division by
# ``sqrt(v) + eps`` scales the CPU's rounding of a near-zero gradient entry up to an lr-sized step.
SGD_STEPS = {"optimizer": "sgd", "record_grads": True}

CASES: dict[str, dict] = {
    # saved at its last step: the checkpoint (experts as DTensors split over ep) converts to HF files
    "ep2": {
        "devices": 2,
        "dp": 2,
        "max_steps": 5,
        "save_every": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"ep": 2},
        **SGD_STEPS,
    },
    # Qwen3-MoE on 2 pipeline stages, without ep: router losses once per microbatch on each stage. 2
    # microbatches: at 4 the AdamW runs differ by up to 2e-3 (an lr-sized update of a gradient near eps
    # differs, later a routing choice), rounding only: pp2_microbatches4_sgd shows it (see its test).
    "pp2": {
        "devices": 2,
        "dp": 1,
        "max_steps": 5,
        "moe": {**MOE, "num_hidden_layers": 4},
        "moe_balance": BALANCE,
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    # the same at 4 microbatches with SGD, every step's gradients recorded: compared tightly by
    # test_moe_pipeline_at_four_microbatches_is_one_process_up_to_rounding, not by the AdamW test
    "pp2_microbatches4_sgd": {
        "devices": 2,
        "dp": 1,
        "max_steps": 5,
        "moe": {**MOE, "num_hidden_layers": 4},
        "moe_balance": BALANCE,
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 4},
        "optimizer": "sgd",
        "record_grads": True,
    },
    # selective recompute around blocks whose experts are an FSDP unit of their own: the unit's hooks run
    # inside the checkpointed region, and the recompute must replay the block's ops as the forward ran them
    "ep2_selective": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"ep": 2, "activation_checkpointing": "selective"},
        **SGD_STEPS,
    },
    # accumulation: the bias moves once per optimizer step, from the load of both micro-steps
    "ep2_accumulate": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "accumulate": 2,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"ep": 2},
        **SGD_STEPS,
    },
    "ep2_dp4": {
        "devices": 4,
        "dp": 4,
        "max_steps": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"dp_shard": 4, "ep": 2},
    },
    # HSDP: experts split over ep inside each dp_shard pair, their gradients all-reduced over dp_replicate
    "ep2_hsdp": {
        "devices": 4,
        "dp": 4,
        "max_steps": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
    },
    "ep2_pp2": {
        "devices": 4,
        "dp": 2,
        "max_steps": 5,
        "moe": {**MOE, "num_hidden_layers": 4},  # layers 0, 2, 3 sparse; 2 stages of 2
        "moe_balance": BALANCE,
        "dims": {"pp": 2, "ep": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    # the reference runs whole sequences: RoPE positions, attention, the router losses and the bias update must
    # not see the split
    "cp2": {
        "devices": 2,
        "dp": 1,
        "max_steps": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"cp": 2},
    },
    # ep groups are consecutive ranks: each ep pair is a cp pair, inside one of 2 data replicas. With SGD and
    # every step's gradients recorded (compared tightly below): under AdamW this case's embedding rows hold
    # gradient entries near eps, which AdamW amplifies past the 1e-5 band (9.2e-6 before the experts' gate and up
    # became one parameter, whose init changed the trajectory; 2.2e-5 after), while the gradients agree to rounding
    "ep2_cp2_dp2_sgd": {
        "devices": 4,
        "dp": 2,
        "max_steps": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"dp_shard": 2, "cp": 2, "ep": 2},
        "optimizer": "sgd",
        "record_grads": True,
    },
    # pipeline stages, each context- and expert-parallel over the same 2 ranks: the stages pass this rank's
    # sequence parts on, RoPE rotates by the global positions on every stage
    "ep2_cp2_pp2": {
        "devices": 4,
        "dp": 1,
        "max_steps": 5,
        "moe": {**MOE, "num_hidden_layers": 4},
        "moe_balance": BALANCE,
        "dims": {"pp": 2, "cp": 2, "ep": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


def config_of(case: str) -> dict:
    return {**BASE, **CASES[case]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    return launcher_by_world_size(CASES, tmp_path_factory, "ep")


@pytest.mark.parametrize("case", sorted(case for case in CASES if not CASES[case].get("record_grads")))
def test_expert_parallel_matches_single_process_loop(case: str, launched: Callable[[str], dict]) -> None:
    config = config_of(case)
    actual = launched(case)
    assert_matches_reference(actual, config)
    assert_moe_run(actual, config)


def assert_moe_run(actual: dict, config: dict) -> None:
    """What every case's run shows beside its parity: the blocks checkpointed where asked, and the excluded
    experts got no token (the load of every logged layer has a 0, and is uneven)."""
    if config["dims"].get("activation_checkpointing"):
        assert actual["checkpointed_modules"] == Qwen3MoeConfig.tiny(**config["moe"]).num_hidden_layers
    loads = actual["moe_load"]
    minima = [value for name, value in loads.items() if name.endswith("load_min")]
    assert minima and all(value == 0 for value in minima), loads
    assert all(value > 0.3 for name, value in loads.items() if name.endswith("load_cv")), loads


@pytest.mark.parametrize("case", sorted(case for case in CASES if CASES[case].get("record_grads")))
def test_moe_parallel_runs_are_one_process_up_to_rounding(case: str, launched: Callable[[str], dict]) -> None:
    """Qwen3-MoE against the single-process loop, with SGD and every step's gradients compared: on pp=2 with 4
    microbatches (router losses, the bias update, uneven loads; the loop runs the same 4 microbatch forwards: the
    router losses are per forward, as in d9d and Megatron), at ep 2 x cp 2 x dp 2, and ep=2 on two ranks (plain,
    with accumulation, with selective recompute). With AdamW at lr 1e-3 the
    pipeline case differs after 5 steps by up to 1e-5 (router losses off) to 2e-3 (on): AdamW divides by
    ``sqrt(v) + eps``, so a gradient entry near ``eps`` (seen: -7.48e-8 vs -7.81e-8 in an embedding row, 2e-7 of
    its row's largest entry) moves by a visibly different fraction of lr (replayed alone through AdamW: 1.12e-5
    apart after 5 steps, 3e-12 through SGD), and a router weight moved so can flip a near-tied top-k choice. The
    gradients themselves agree to rounding on every step, and SGD (no amplification) keeps the parameters an ulp
    apart: a microbatch counted twice, scaled wrongly, or a router loss normalised differently would be ~1e-3 of
    a gradient off (``assert_same_step_grads``)."""
    actual = launched(case)
    assert_matches_reference(actual, config_of(case))
    assert_moe_run(actual, config_of(case))


def test_expert_parallel_checkpoint_converts_to_hf(launched: Callable[[str], dict], tmp_path: Path) -> None:
    actual = launched("ep2")
    checkpoints: Path = launched.checkpoints  # type: ignore[attr-defined]
    config = Qwen3MoeConfig.tiny(**MOE)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(config.to_hf_dict()))
    out = tmp_path / "hf"
    assert (
        convert(
            [
                "dcp-to-hf",
                str(checkpoints / "ep2" / "step=5.ckpt"),
                str(out),
                "--config",
                str(tmp_path / "config"),
            ]
        )
        == 0
    )
    # the experts come back whole (both ep shards), in transformers' per-expert layout
    files: dict[str, torch.Tensor] = {}
    for part in out.glob("*.safetensors"):
        files.update(load_file(str(part)))
    assert files["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (
        config.hidden_size,
        config.moe_intermediate_size,
    )
    # the selection bias travels as DeepSeek-V3's e_score_correction_bias (transformers' Qwen3-MoE has none)
    bias = files["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias[6] < -990 and bias[7] < -990 and bias[:6].abs().max() > 0
    ours = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_hf_dict(json.loads((out / "config.json").read_text())))
    assert ours.config.router_selection_bias
    load_hf(ours, out)
    for name, param in ours.named_parameters():
        assert torch.equal(param.detach(), actual["params"]["model." + name]), name
    torch.testing.assert_close(ours.model.layers["0"].mlp.gate.expert_bias, bias, rtol=0, atol=0)
