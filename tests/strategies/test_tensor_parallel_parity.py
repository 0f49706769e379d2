"""Tensor + sequence + loss parallelism inside Lightning's loop against a single-process loop (fp32, 1e-5).

Losses, parameters and the gradient norm before clipping after 5 optimizer steps; tp alone (with accumulation,
with clipping, with tied embeddings, compiled with full recompute), tp under FSDP (2-D), pp x dp_shard x tp on 8
processes, and checkpoints carried between tp=2 and tp=1.
All runs share one launch (``run_forked``).
"""

from __future__ import annotations

import pytest
from test_pipeline_parity import run_forked
from test_trainer_parity import BASE, assert_matches_reference, assert_same_grad_norms, assert_same_training

from lightning_d9d.models import Qwen3Config

TP2 = {"devices": 2, "dp": 1, "max_steps": 5, "dims": {"tp": 2}}
# A checkpoint every 2 steps of 4-batch epochs: step 6 is in the middle of an epoch.
RESUMABLE = {"max_steps": 8, "steps_per_epoch": 4, "save_every": 2}
RESUME_STEP = 6

CASES: dict[str, dict] = {
    "tp2": {**TP2, "validate": True},
    # without clipping: a clip threshold that bites rescales away any gradient-scale error
    "tp2_accumulate": {**TP2, "accumulate": 2},
    "tp2_accumulate_clip": {**TP2, "accumulate": 2, "clip": 0.05},
    # the embedding and the head are one Parameter, split over the vocabulary by both
    "tp2_tied": {**TP2, "model": {"tie_word_embeddings": True}},
    "tp2_resumable": {**TP2, **RESUMABLE},
    # full recompute of compiled tp blocks: one graph for both failed in AOTAutograd (torch 2.13), so the
    # checkpoint wraps the compiled block; dynamo + AOTAutograd without Inductor's code generation
    "tp2_full_checkpointing_compiled": {
        **TP2,
        "max_steps": 3,
        "dims": {"tp": 2, "activation_checkpointing": True, "compile": True},
        "compile_backend": "aot_eager",
    },
    # tp=1 on as many processes: plain FSDP, so a resume also reshards between FSDP and tp
    "tp1_resumable": {"devices": 2, "dp": 2, **RESUMABLE, "dims": {"dp_shard": 2}},
    # 2-D: FSDP over dp_shard shards the tp shards; padded labels weigh the data ranks by their tokens
    "tp2_dp2": {"devices": 4, "dp": 2, "max_steps": 5, "dims": {"tp": 2, "dp_shard": 2}},
    "tp2_dp2_padded_clip": {
        "devices": 4,
        "dp": 2,
        "max_steps": 5,
        "pad": True,
        "lr": 3e-4,  # see fsdp2_padded in test_trainer_parity.py
        "clip": 0.05,
        "dims": {"tp": 2, "dp_shard": 2},
    },
    # pipeline stages, each tensor-parallel: hidden states travel between stages as sequence shards, the
    # last stage's loss runs from vocabulary-sharded logits inside the schedule
    "pp2_tp2_accumulate_clip": {
        "devices": 4,
        "dp": 1,
        "max_steps": 5,
        "accumulate": 2,
        "clip": 0.05,
        "validate": True,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "tp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    # 3-D on 8 processes: two tensor-parallel pipeline stages, each sharded by FSDP over dp_shard=2
    "pp2_dp2_tp2_padded": {
        "devices": 8,
        "dp": 2,
        "max_steps": 5,
        "pad": True,
        "lr": 3e-4,  # see fsdp2_padded in test_trainer_parity.py
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "dp_shard": 2, "tp": 2, "pipeline_schedule": "Interleaved1F1B", "microbatches": 4},
    },
}
# (case saved, layout resumed on): tp=2 -> tp=1 and tp=1 -> tp=2, from the mid-epoch checkpoint
RESUMES = {"tp2_resumable": "tp1_resumable", "tp1_resumable": "tp2_resumable"}


def config_of(case: str) -> dict:
    return {**BASE, **CASES[case]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case, and ``<saved>_on_<resumed on>`` for the resumes, in one launch: stretches of 2, 4 and 8
    ranks, then the resumes on 2 new ranks (not the processes that saved)."""
    tmp = tmp_path_factory.mktemp("tp")
    configs = {
        case: {**config, "ckpt_dir": str(tmp / "checkpoints" / case)} if config.get("save_every") else config
        for case, config in sorted(CASES.items(), key=lambda item: item[1]["devices"])
    }
    for saved, resumed_on in RESUMES.items():
        configs[f"{saved}_on_{resumed_on}"] = {
            **CASES[resumed_on],
            "save_every": 0,
            "resume_from": str(tmp / "checkpoints" / saved / f"step={RESUME_STEP}.ckpt"),
        }
    return run_forked(configs, tmp)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_single_process_loop(case: str, runs: dict) -> None:
    assert_matches_reference(runs[case], config_of(case))
    dims = CASES[case]["dims"]
    layers = Qwen3Config.tiny(**CASES[case].get("model", {})).num_hidden_layers
    assert runs[case]["compiled_modules"] == (layers if dims.get("compile") else 0)
    assert runs[case]["checkpointed_modules"] == (layers if dims.get("activation_checkpointing") else 0)


def test_checkpoints_move_between_tp2_and_tp1(runs: dict) -> None:
    """A checkpoint saved at tp=2 resumes at tp=1 and one saved at tp=1 resumes at tp=2 (DCP reshards the
    tp-sharded parameters and optimizer state), each continuing like the uninterrupted run."""
    for saved, resumed_on in RESUMES.items():
        full, resumed = runs[saved], runs[f"{saved}_on_{resumed_on}"]
        assert_same_training(
            {"losses": resumed["losses"], "params": resumed["params"]},
            {"losses": full["losses"][RESUME_STEP:], "params": full["params"]},
        )
        assert_same_grad_norms(
            {"grad_norms": resumed["grad_norms"]}, {"grad_norms": full["grad_norms"][RESUME_STEP:]}
        )
