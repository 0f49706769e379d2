"""Pipeline parallelism inside Lightning's loop: every torch schedule against a single-process loop (fp32, 1e-5).

Every run of this module shares one launch (``run_forked``): process start-up was most of the cost of these
small runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import reference_run
from test_trainer_parity import (
    BASE,
    SCRIPT,
    assert_same_grad_norms,
    assert_same_training,
    first_errors,
)

from lightning_d9d.pipeline import SCHEDULES as PIPELINE_SCHEDULES

SCHEDULES = list(PIPELINE_SCHEDULES)
# lr 1e-3: AdamW turns tiny summation-order differences of near-zero gradients into parameter differences
# proportional to lr; microbatching changes the summation order.
COMMON = {**BASE, "lr": 1e-3, "max_steps": 5, "model": {"num_hidden_layers": 4}}
ACCUMULATE_CLIP = {"accumulate": 2, "clip": 0.05}
# Without clipping too: a threshold that bites on every step rescales away a gradient-scale error.
ACCUMULATE = {"accumulate": 2}
PP2_VARIANTS = {
    "plain": {},
    "accumulate2_clip": ACCUMULATE_CLIP,
    "accumulate2": ACCUMULATE,
    # padded labels: microbatches hold different token counts (the loss weighs them by their tokens)
    "padded": {"pad": True},
    # a loss that does not count its items: microbatches weigh the same
    "accumulate2_uncounted": {**ACCUMULATE, "uncounted_loss": True},
    # packed rows (several documents each): every stage of every microbatch gets the positions
    "packed": {"packed": True},
}
PP2_CASES = [(schedule, "plain") for schedule in SCHEDULES]
# accumulation with and without clipping: each schedule one of the two (clipping leaves a gradient-scale error
# unseen where it bites on every step; the unclipped runs would show it)
CLIPPED = ("GPipe", "Interleaved1F1B", "LoopedBFS", "DualPipeV")
PP2_CASES += [(schedule, "accumulate2_clip") for schedule in CLIPPED]
PP2_CASES += [(schedule, "accumulate2") for schedule in SCHEDULES if schedule not in CLIPPED]
PP2_CASES += [("1F1B", "padded"), ("Interleaved1F1B", "padded"), ("1F1B", "accumulate2_uncounted")]
# packed rows: one and two stages a rank, split backward (positions reach every stage of every microbatch)
PP2_CASES += [(schedule, "packed") for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")]


def pp2(schedule: str, variant: str) -> dict:
    extra = PP2_VARIANTS[variant]
    validate = schedule in ("ZBVZeroBubble", "DualPipeV", "1F1B")  # eval() fails for the V schedules in torch
    dims = {"pp": 2, "dp_shard": 1, "pipeline_schedule": schedule, "microbatches": 4}
    return {**COMMON, **extra, "devices": 2, "dp": 1, "dims": dims, "validate": validate}


def four_ranks(pp: int, schedule: str, microbatches: int, **extra: object) -> dict:
    dims = {"pp": pp, "dp_shard": 4 // pp, "pipeline_schedule": schedule, "microbatches": microbatches}
    return {"dims": dims, "dp": 4 // pp, **extra}


FOUR_RANKS = {
    "pp4_1F1B": four_ranks(4, "1F1B", 4),
    "pp4_1F1B_acc": four_ranks(4, "1F1B", 4, **ACCUMULATE_CLIP),
    # the embedding (stage 0) tied to the head (stage 3), the middle ranks holding neither: built on meta, each
    # copy initialised under its own name, then stage 0's value; their gradients summed, the norm counting one
    "pp4_1F1B_tied_acc": four_ranks(
        4, "1F1B", 4, model={"num_hidden_layers": 4, "tie_word_embeddings": True}, **ACCUMULATE
    ),
    "pp4_Interleaved1F1B": four_ranks(4, "Interleaved1F1B", 8, model={"num_hidden_layers": 8}),
    "pp4_Interleaved1F1B_acc": four_ranks(
        4, "Interleaved1F1B", 8, model={"num_hidden_layers": 8}, **ACCUMULATE_CLIP
    ),
    # pp=2 x dp_shard=2: every schedule
    "pp2_dp2_GPipe": four_ranks(2, "GPipe", 2),
    "pp2_dp2_1F1B_acc": four_ranks(2, "1F1B", 2, validate=True, **ACCUMULATE_CLIP),
    "pp2_dp2_1F1B_acc_noclip": four_ranks(2, "1F1B", 2, **ACCUMULATE),
    "pp2_dp2_1F1B_padded": four_ranks(2, "1F1B", 2, validate=True, pad=True),
    "pp2_dp2_Interleaved1F1B": four_ranks(2, "Interleaved1F1B", 4),
    "pp2_dp2_LoopedBFS_acc": four_ranks(2, "LoopedBFS", 4, **ACCUMULATE_CLIP),
    "pp2_dp2_InterleavedZeroBubble": four_ranks(2, "InterleavedZeroBubble", 4),
    "pp2_dp2_ZBV_acc": four_ranks(2, "ZBVZeroBubble", 4, **ACCUMULATE_CLIP),
    "pp2_dp2_DualPipeV": four_ranks(2, "DualPipeV", 4, validate=True),
    # packed rows through pipeline stages that are context-parallel: positions split and gathered per stage
    "pp2_cp2_1F1B_packed": {
        "dims": {"pp": 2, "cp": 2, "dp_shard": 1, "pipeline_schedule": "1F1B", "microbatches": 2},
        "dp": 1,
        "packed": True,
        "validate": True,
    },
}


def four_ranks_config(name: str) -> dict:
    return {**COMMON, "devices": 4, **FOUR_RANKS[name]}


def run_forked(configs: dict[str, dict], tmp_path: Path) -> dict[str, dict]:
    """``{name: result}`` of the named configs (on ``BASE``), run in one launch in dict order (a checkpoint is
    written before a later run resumes from it): ``trainer_script.py --fork`` makes the imports once and forks
    the ranks of each stretch of configs with the same ``devices``. Started by torchrun instead, every rank of
    every launch imported torch and Lightning itself (about 7 s of CPU each, 4-8 processes on 2 cores), and
    torchrun too: an empty 8-rank launch (the imports only) took 38 s here, 72 s of CPU, on 2 cores."""
    placed = [{**BASE, **config, "out": str(tmp_path / f"{name}.pt")} for name, config in configs.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(SCRIPT), "--fork", json.dumps(placed)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(
            f"forked trainer runs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n"
            f"first error lines of every rank:\n{first_errors(proc.stderr)}"
        )
    return {
        name: torch.load(one["out"], weights_only=False) for name, one in zip(configs, placed, strict=True)
    }


_references: dict[str, dict] = {}


def reference_for(config: dict) -> dict:
    key = repr(sorted((k, v) for k, v in config.items() if k not in ("dims", "devices", "dp", "out")))
    if key not in _references:
        _references[key] = reference_run(config)
    return _references[key]


def check(actual: dict, config: dict) -> None:
    expected = reference_for(config)
    assert_same_training(actual, expected)
    assert_same_grad_norms(actual, expected)
    if config.get("clip"):
        assert min(expected["grad_norms"]) > config["clip"]  # clipping bites on every step
    if config.get("validate"):
        assert abs(actual["val_loss"] - expected["val_loss"]) <= 1e-5


@pytest.mark.parametrize(("schedule", "variant"), PP2_CASES, ids=[f"{s}-{v}" for s, v in PP2_CASES])
def test_pp2_schedule_matches_one_process(schedule: str, variant: str, runs: dict) -> None:
    check(runs[f"pp2_{schedule}_{variant}"], pp2(schedule, variant))


@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_four_ranks_match_one_process(name: str, runs: dict) -> None:
    check(runs[f"four_{name}"], four_ranks_config(name))


# 7 of 14 steps, 4-batch epochs: a mid-epoch position, resumed on the same layout and carried to the other
RESUME = {**COMMON, "max_steps": 14, "schedule_steps": 14, "steps_per_epoch": 4, "save_every": 7, "dp": 2}
PP2_DP2 = {"pp": 2, "dp_shard": 2, "pipeline_schedule": "1F1B", "microbatches": 2}
LAYOUTS = {"pp2_dp2": {"devices": 4, "dims": PP2_DP2}, "pp1_dp2": {"devices": 2, "dims": {"dp_shard": 2}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run of this module, in one launch of three stretches, each on freshly forked ranks: 4 ranks (the
    4-rank layouts; pp2_dp2 for 14 steps), 2 ranks (the pp=2 schedules; pp1_dp2 for 14 steps, and resumed from
    pp2_dp2's step 7), 4 ranks (pp2_dp2 resumed from each layout's step 7: not in the processes that saved).
    ``pp2_<schedule>_<variant>``, ``four_<name>``, and for the resumes ``resume_<layout>`` (uninterrupted) and
    ``resume_<saved>_to_<resumed>``."""
    tmp = tmp_path_factory.mktemp("pp")

    def step7(saved: str, resumed: str) -> dict:
        checkpoint = tmp / "checkpoints" / saved / "step=7.ckpt"
        return {**RESUME, **LAYOUTS[resumed], "save_every": 0, "resume_from": str(checkpoint)}

    def saving(layout: str) -> dict:
        return {**RESUME, **LAYOUTS[layout], "ckpt_dir": str(tmp / "checkpoints" / layout)}

    configs = {f"four_{name}": four_ranks_config(name) for name in FOUR_RANKS}
    configs["resume_pp2_dp2"] = saving("pp2_dp2")
    configs.update({f"pp2_{schedule}_{variant}": pp2(schedule, variant) for schedule, variant in PP2_CASES})
    configs["resume_pp1_dp2"] = saving("pp1_dp2")
    configs["resume_pp2_dp2_to_pp1_dp2"] = step7("pp2_dp2", "pp1_dp2")
    configs["resume_pp1_dp2_to_pp2_dp2"] = step7("pp1_dp2", "pp2_dp2")
    configs["resume_pp2_dp2_to_pp2_dp2"] = step7("pp2_dp2", "pp2_dp2")
    return run_forked(configs, tmp)


@pytest.mark.parametrize(
    ("first", "second", "tolerance"),
    [("pp2_dp2", "pp2_dp2", 0.0), ("pp2_dp2", "pp1_dp2", 1e-5), ("pp1_dp2", "pp2_dp2", 1e-5)],
)
def test_checkpoint_resumes_exactly_on_the_same_or_another_pipeline_layout(
    first: str, second: str, tolerance: float, runs: dict
) -> None:
    """7 steps, stop, resume to 14: bit for bit the 14 uninterrupted steps on the same layout, within 1e-5 on
    the other (microbatching changes the summation order)."""
    uninterrupted, resumed = runs[f"resume_{first}"], runs[f"resume_{first}_to_{second}"]
    assert len(resumed["losses"]) == 7
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": uninterrupted["losses"][7:], "params": uninterrupted["params"]},
        tolerance=tolerance,
    )
    if tolerance == 0.0:
        assert resumed["grad_norms"] == uninterrupted["grad_norms"][7:]
    assert_same_training(uninterrupted, reference_for({**RESUME, **LAYOUTS[first]}))
