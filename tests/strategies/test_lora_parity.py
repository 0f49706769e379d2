"""LoRA inside Lightning's loop on every degree against a single-process loop with the same adapters (fp32, gloo,
1e-5): losses, parameters and pre-clip gradient norms after 5 AdamW steps; the frozen weights bit for bit
the initial ones; only the adapters train and hold optimizer state.

Cases: dp_shard=2, tp=2 (adapters split with their layers), pp=2, cp=2, ep=2 on Qwen3-MoE (the attention
adapted, the experts split over ep; and with ``experts=True``, per-expert adapters split over ep with their
experts), tp=2 on Qwen3-MoE with ``experts=True`` (the MoE blocks token-local: the experts' adapters whole, their
gradients summed over tp), tp=2 x dp_shard=2 and HSDP dp_replicate=2 x dp_shard=2 (4 processes); a checkpoint saved at tp=2 resumed at dp_shard=2
(AdamW: its state is the adapters' alone). All share one launch (``run_forked``).
"""

from __future__ import annotations

import pytest
from reference import reference_run
from test_pipeline_parity import run_forked
from test_trainer_parity import BASE, assert_same_grad_norms, assert_same_training

# SGD at lr 0.1: the adapters move the loss within 5 steps, and the parameters then differ from the one-process
# run's by the gradients' own rounding times lr (~1e-8 here). Under AdamW the first steps divide the adapters'
# near-zero gradients (B starts at zero) by sqrt(v) + eps, which scales the summation order's rounding up to
# 1e-4 (seen at lr 1e-2); the resumable case runs AdamW, whose state a checkpoint carries.
LORA = {"rank": 4, "alpha": 8.0}
COMMON = {**BASE, "optimizer": "sgd", "lr": 0.1, "max_steps": 5, "lora": LORA}
ATTENTION = {**LORA, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
EXPERTS = {**ATTENTION, "experts": True}
MOE = {"router_selection_bias": True, "router_z_loss_coef": 1e-3}
RESUMABLE = {"max_steps": 8, "steps_per_epoch": 4, "save_every": 2}
RESUME_STEP = 6

CASES: dict[str, dict] = {
    "dp2": {"devices": 2, "dp": 2, "dims": {"dp_shard": 2}},
    "tp2": {"devices": 2, "dp": 1, "dims": {"tp": 2}, "validate": True},
    "pp2": {
        "devices": 2,
        "dp": 1,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    "cp2": {"devices": 2, "dp": 1, "dims": {"cp": 2}},
    "ep2_moe": {"devices": 2, "dp": 2, "moe": MOE, "lora": ATTENTION, "dims": {"ep": 2}},
    "ep2_moe_experts": {"devices": 2, "dp": 2, "moe": MOE, "lora": EXPERTS, "dims": {"ep": 2}},
    "tp2_moe_experts": {"devices": 2, "dp": 1, "moe": MOE, "lora": EXPERTS, "dims": {"tp": 2}},
    "tp2_dp2": {"devices": 4, "dp": 2, "dims": {"tp": 2, "dp_shard": 2}},
    # HSDP: adapters sharded over dp_shard, replicated over dp_replicate
    "hsdp2x2": {"devices": 4, "dp": 4, "dims": {"dp_replicate": 2, "dp_shard": 2}},
    # AdamW, saved mid-epoch at tp=2, resumed at dp_shard=2 (below)
    "tp2_resumable": {
        "devices": 2,
        "dp": 1,
        "dims": {"tp": 2},
        "optimizer": "adamw",
        "lr": 1e-3,
        **RESUMABLE,
    },
    # compiled blocks (dynamo + AOTAutograd, no Inductor code generation on CPU) with full recompute
    "dp2_compiled_checkpointed": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "dims": {"dp_shard": 2, "compile": True, "activation_checkpointing": True},
        "compile_backend": "aot_eager",
    },
}
# Full fine-tuning with modules the user froze (no LoRA): the embedding, the first layer's attention and every
# input norm (replicated over tp, where torch's sequence-parallel style would make them trainable again)
FROZEN = ["embed_tokens", "layers.0.self_attn", "input_layernorm"]
FROZEN_CASES: dict[str, dict] = {
    "frozen_tp2_dp2": {"devices": 4, "dp": 2, "dims": {"tp": 2, "dp_shard": 2}},
    "frozen_pp2": {
        "devices": 2,
        "dp": 1,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


def config_of(case: str) -> dict:
    if case in FROZEN_CASES:
        return {**COMMON, "lora": None, "freeze": FROZEN, **FROZEN_CASES[case]}
    return {**COMMON, **CASES[case]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    every = {**CASES, **FROZEN_CASES}
    configs = {
        case: {**config_of(case), "ckpt_dir": str(tmp / "checkpoints" / case)}
        for case in sorted(every, key=lambda case: every[case]["devices"])
    }
    configs["tp2_resumed_on_dp2"] = {
        **config_of("tp2_resumable"),
        "devices": 2,
        "dp": 2,
        "dims": {"dp_shard": 2},
        "save_every": 0,
        "resume_from": str(tmp / "checkpoints" / "tp2_resumable" / f"step={RESUME_STEP}.ckpt"),
    }
    configs["tp2_resumed_on_tp2"] = {
        **config_of("tp2_resumable"),
        "save_every": 0,
        "resume_from": str(tmp / "checkpoints" / "tp2_resumable" / f"step={RESUME_STEP}.ckpt"),
    }
    return run_forked(configs, tmp)


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_matches_one_process(case: str, runs: dict) -> None:
    config = config_of(case)
    actual, expected = runs[case], reference_run(config)
    assert_same_training(actual, expected)
    assert_same_grad_norms(actual, expected)
    if config.get("validate"):
        assert abs(actual["val_loss"] - expected["val_loss"]) <= 1e-5
    adapters = sorted(name for name in actual["params"] if _adapter(name))
    # rank 0's parameters (under pp its stage's): the adapters alone train, and AdamW keeps state for them alone
    assert actual["trainable"] and set(actual["trainable"]) <= set(adapters)
    if config["optimizer"] == "adamw":
        assert actual["optimizer_state"] == actual["trainable"]
    for name, value in actual["params"].items():  # the base: the one-process run's initial values, exactly
        if not _adapter(name):
            assert value.equal(expected["params"][name].float()), f"frozen {name} changed"
    # the adapters trained (B left zero would hide a wrong A entirely)
    assert all(actual["params"][name].abs().max() > 0 for name in adapters if ".lora_B." in name)


def test_lora_checkpoint_resumes_bit_for_bit_on_the_same_layout(runs: dict) -> None:
    """The adapters-only checkpoint (the base left out, loaded again and checked by fingerprint) resumes mid-epoch
    exactly where the uninterrupted run went on: the same losses, gradient norms and parameters, bit for bit."""
    full, resumed = runs["tp2_resumable"], runs["tp2_resumed_on_tp2"]
    assert resumed["losses"] == full["losses"][RESUME_STEP:]
    assert resumed["grad_norms"] == full["grad_norms"][RESUME_STEP:]
    assert all(resumed["params"][name].equal(value) for name, value in full["params"].items())


def test_lora_checkpoint_resumes_on_another_layout(runs: dict) -> None:
    """A mid-epoch checkpoint of a tp=2 run resumes at dp_shard=2 and continues like the uninterrupted run."""
    full, resumed = runs["tp2_resumable"], runs["tp2_resumed_on_dp2"]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][RESUME_STEP:], "params": full["params"]},
    )
    assert_same_grad_norms(
        {"grad_norms": resumed["grad_norms"]}, {"grad_norms": full["grad_norms"][RESUME_STEP:]}
    )


@pytest.mark.parametrize("case", sorted(FROZEN_CASES))
def test_frozen_modules_stay_frozen_on_every_degree(case: str, runs: dict) -> None:
    """A full fine-tune with some modules frozen by the user: the rest trains as in one process, the frozen ones
    keep their initial values bit for bit and get no optimizer state."""
    actual, expected = runs[case], reference_run(config_of(case))
    assert_same_training(actual, expected)
    assert_same_grad_norms(actual, expected)
    frozen = [name for name in actual["params"] if any(part in name for part in FROZEN)]
    assert {part for part in FROZEN if any(part in name for name in frozen)} == set(FROZEN)
    assert not set(frozen) & set(actual["trainable"]) and actual["trainable"]
    for name in frozen:
        assert actual["params"][name].equal(expected["params"][name].float()), f"frozen {name} changed"
