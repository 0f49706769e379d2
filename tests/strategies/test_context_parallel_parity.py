"""Context parallelism inside Lightning's loop against a single-process loop (fp32, 1e-5).

Losses, parameters and the gradient norm before clipping after 5 optimizer steps: cp=2 alone (with padded labels
that leave the cp ranks different token counts and validation, with accumulation, with clipping), cp=2 under
FSDP over dp_shard x cp, tp=2 x cp=2 and pp=2 x cp=2; a checkpoint saved at cp=2 resumed at cp=1. Runs of one world size
share one launch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_trainer_parity import (
    BASE,
    assert_matches_reference,
    assert_same_grad_norms,
    assert_same_training,
    launcher_by_world_size,
)

CP2 = {"devices": 2, "dp": 1, "max_steps": 5, "dims": {"cp": 2}}
# A checkpoint every 2 steps of 4-batch epochs: step 6 is in the middle of an epoch.
RESUMABLE = {"max_steps": 8, "steps_per_epoch": 4, "save_every": 2}
RESUME_STEP = 6

CASES: dict[str, dict] = {
    # padding at the end of sequences: the rank holding the tail chunks counts fewer tokens; lr as in
    # test_trainer_parity.py's fsdp2_padded
    "cp2_padded": {**CP2, "pad": True, "lr": 3e-4, "validate": True},
    # without clipping: a clip threshold that bites rescales away any gradient-scale error
    "cp2_accumulate": {**CP2, "accumulate": 2},
    "cp2_accumulate_clip": {**CP2, "accumulate": 2, "clip": 0.05},
    # saves checkpoints, from which cp2_resumed_on_dp2 (later in the same launch) resumes
    "cp2_resumable": {**CP2, **RESUMABLE},
    # cp=1 on as many processes (plain FSDP over dp_shard=2, two data replicas) from cp2_resumable's step 6
    "cp2_resumed_on_dp2": {
        "devices": 2,
        "dp": 2,
        **RESUMABLE,
        "save_every": 0,
        "dims": {"dp_shard": 2},
        "resume_from": f"cp2_resumable/step={RESUME_STEP}.ckpt",
    },
    # FSDP over dp_shard x cp (4 ranks): two data replicas, each sequence split over 2 cp ranks
    "cp2_dp2": {"devices": 4, "dp": 2, "max_steps": 5, "dims": {"cp": 2, "dp_shard": 2}},
    # tp inside each cp rank: sequence parallelism over the rank's chunks, heads split over tp, the K/V heads
    # gathered over cp. lr 3e-4: at 1e-3 AdamW turned the summation-order noise of a near-zero q_proj gradient
    # into 1.2e-5 (losses agreed to 5e-7, gradient norms to 1.4e-7 relative)
    "tp2_cp2": {"devices": 4, "dp": 1, "max_steps": 5, "lr": 3e-4, "dims": {"tp": 2, "cp": 2}},
    # pipeline stages, each context-parallel: the stages pass this rank's chunks on, RoPE rotates by the global
    # positions on every stage, the last stage's loss counts its local tokens (padded: unequal counts)
    "pp2_cp2_padded_accumulate": {
        "devices": 4,
        "dp": 1,
        "max_steps": 5,
        "pad": True,
        "lr": 3e-4,
        "accumulate": 2,
        "validate": True,
        "model": {"num_hidden_layers": 4},
        "dims": {"pp": 2, "cp": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    return launcher_by_world_size(CASES, tmp_path_factory, "cp")


@pytest.mark.parametrize("case", sorted(name for name in CASES if not CASES[name].get("resume_from")))
def test_matches_single_process_loop(case: str, launched: Callable[[str], dict]) -> None:
    config = {**BASE, **CASES[case]}
    assert_matches_reference(launched(case), config)


def test_checkpoint_saved_with_cp2_resumes_with_cp1(launched: Callable[[str], dict]) -> None:
    """A checkpoint saved at cp=2 (step 6, mid-epoch) resumes at cp=1 (FSDP over dp_shard=2) and continues like
    the uninterrupted cp=2 run."""
    full, resumed = launched("cp2_resumable"), launched("cp2_resumed_on_dp2")
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][RESUME_STEP:], "params": full["params"]},
    )
    assert_same_grad_norms(
        {"grad_norms": resumed["grad_norms"]}, {"grad_norms": full["grad_norms"][RESUME_STEP:]}
    )
