"""Muon through ``D9DStrategy`` and a Trainer fit, against the single-process loop (fp32, gloo, 1e-5).

The user's path: ``configure_optimizers`` returns ``Muon(muon_param_groups(self.model), ...)`` under the module's
learning-rate schedule, built after the strategy parallelized the model (DTensor parameters under FSDP's, tp's and
the pipeline stages' names). Layouts: tp=2 with norm clipping through the precision plugin, pp=2 (1F1B), and
tp=2 x dp_shard=2; a checkpoint saved by ``ModelCheckpoint`` at tp=2 resumes on tp=2 and on one process (tp=1),
each continuing like the uninterrupted run. All runs share one launch (``run_forked``), one stretch per world size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_pipeline_parity import reference_for, run_forked
from test_trainer_parity import BASE, assert_same_grad_norms, assert_same_training

MUON = {**BASE, "optimizer": "muon", "max_steps": 5}
# a checkpoint every 2 steps of 4-batch epochs: step 2 is in the middle of the first epoch
RESUMABLE = {"max_steps": 5, "steps_per_epoch": 4, "save_every": 2}
RESUME_STEP = 2
CASES: dict[str, dict] = {
    # the clip threshold bites on every step: Muon's momentum and AdamW's moments see the clipped gradients
    "tp2_clip_resumable": {"devices": 2, "dp": 1, "clip": 0.05, "dims": {"tp": 2}, **RESUMABLE},
    "pp2_1F1B": {
        "devices": 2,
        "dp": 1,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
    "tp2_dp2": {"devices": 4, "dp": 2, "dims": {"tp": 2, "dp_shard": 2}},
}
# the tp=2 checkpoint resumed on new ranks: at tp=2 (exact continuation) and on one process (tp=1)
RESUMES = {
    "tp2_on_tp2": {"devices": 2, "dp": 1, "clip": 0.05, "dims": {"tp": 2}, "new_ranks": True},
    "tp2_on_tp1": {"devices": 1, "dp": 1, "clip": 0.05},
}


def config_of(case: str) -> dict:
    return {**MUON, **CASES[case]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("muon")
    configs = {case: config_of(case) for case in CASES}
    configs["tp2_clip_resumable"]["ckpt_dir"] = str(tmp / "checkpoints")
    checkpoint = str(tmp / "checkpoints" / f"step={RESUME_STEP}.ckpt")
    for name, resumed_on in RESUMES.items():
        configs[name] = {**MUON, **RESUMABLE, **resumed_on, "save_every": 0, "resume_from": checkpoint}
    # one stretch per world size: 2 ranks, 2 new ranks (the resume), 1 rank, 4 ranks
    order = ["tp2_clip_resumable", "pp2_1F1B", "tp2_on_tp2", "tp2_on_tp1", "tp2_dp2"]
    return run_forked({name: configs[name] for name in order}, tmp)


@pytest.mark.parametrize("case", sorted(CASES))
def test_muon_in_the_trainer_matches_one_process(case: str, runs: dict) -> None:
    config = config_of(case)
    expected = reference_for(config)
    assert_same_training(runs[case], expected)
    assert_same_grad_norms(runs[case], expected)
    if config.get("clip"):
        assert min(expected["grad_norms"]) > config["clip"]  # clipping bites on every step
    # every parameter this rank holds has state (rank 0's: under pp the first stage's)
    held = runs[case]["optimizer_state"]
    assert (
        held == sorted(expected["params"])
        if not config["dims"].get("pp")
        else set(held) < set(expected["params"])
    )
    assert runs[case]["dtensor_params"]


@pytest.mark.parametrize("resume", sorted(RESUMES))
def test_a_tp2_checkpoint_resumes_exactly(resume: str, runs: dict) -> None:
    """Resumed from step 2 on new ranks, at tp=2 and on one process: the same losses and gradient norms for
    steps 3-5 and the same final parameters as the uninterrupted tp=2 run (DCP reshards parameters, momentum
    buffers and moments)."""
    full, resumed = runs["tp2_clip_resumable"], runs[resume]
    assert resumed["global_step"] == full["global_step"] == 5
    tolerance = 0.0 if resume == "tp2_on_tp2" else 1e-5
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][RESUME_STEP:], "params": full["params"]},
        tolerance,
    )
    assert_same_grad_norms(
        {"grad_norms": resumed["grad_norms"]}, {"grad_norms": full["grad_norms"][RESUME_STEP:]}
    )
