"""Preemption: a SIGUSR1 to one rank of a 2-process run, at several points of a step (the batch's start,
before its backward, before the optimizer step; rank 0 or 1), stops every rank after that step with a complete
checkpoint (``Preemption``), and ``fit`` returns normally; resuming from it gives the uninterrupted run bit for
bit (losses, parameters, gradient norms), which is itself the single-process loop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from reference import reference_run
from test_multi_node import slurm_tasks
from test_trainer_parity import BASE, assert_same_grad_norms, assert_same_training, run_trainer

STEPS = 6
RUN = {
    **BASE,
    "devices": 2,
    "dp": 2,
    "max_steps": STEPS,
    "schedule_steps": STEPS,
    "steps_per_epoch": 4,  # step 5 is in the second epoch
}
ACCUMULATED = {**RUN, "accumulate": 2}  # the signal in the first micro-batch of step 2: stopped after both
BASES = {"uninterrupted": RUN, "uninterrupted_accumulate": ACCUMULATED}
SIGNALS = {
    "at_batch_start": {"rank": 1, "step": 3, "at": "batch_start"},
    "at_backward": {"rank": 0, "step": 2, "at": "backward"},
    "at_optimizer": {"rank": 1, "step": 5, "at": "optimizer"},
    "at_backward_accumulate": {"rank": 1, "step": 2, "at": "backward"},
}


def base_of(name: str) -> str:
    return "uninterrupted_accumulate" if name.endswith("_accumulate") else "uninterrupted"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("preemption")
    names = [*BASES, *SIGNALS]
    configs = list(BASES.values()) + [
        {**BASES[base_of(name)], "preempt": where, "ckpt_dir": str(tmp / name)}
        for name, where in SIGNALS.items()
    ]
    interrupted = run_trainer(configs, tmp, "preempt", names=names, fork=True)
    resumes = [{**BASES[base_of(name)], "resume_from": interrupted[name]["preempted"]} for name in SIGNALS]
    resumed = run_trainer(resumes, tmp, "resumed", names=list(SIGNALS), fork=True)
    return {"interrupted": interrupted, "resumed": resumed}


@pytest.mark.parametrize("base", list(BASES))
def test_the_uninterrupted_run_is_the_single_process_loop(runs: dict[str, dict], base: str) -> None:
    full, expected = runs["interrupted"][base], reference_run(BASES[base])
    assert full["preempted"] is None and full["global_step"] == STEPS
    assert_same_training(full, expected)
    assert_same_grad_norms(full, expected)


@pytest.mark.parametrize("name", list(SIGNALS))
def test_a_signal_stops_every_rank_after_its_step_with_a_checkpoint(runs: dict[str, dict], name: str) -> None:
    step, got = SIGNALS[name]["step"], runs["interrupted"][name]
    full, batches = runs["interrupted"][base_of(name)], step * BASES[base_of(name)].get("accumulate", 1)
    assert got["global_step"] == step  # stopped after the step the signal came in, not before, not later
    assert Path(got["preempted"]).name == f"preempted-step={step}.ckpt"
    assert (Path(got["preempted"]) / "manifest.json").is_file()  # complete
    assert got["losses"] == full["losses"][:batches]


@pytest.mark.parametrize("name", list(SIGNALS))
def test_the_resumed_run_is_the_uninterrupted_one(runs: dict[str, dict], name: str) -> None:
    step, resumed = SIGNALS[name]["step"], runs["resumed"][name]
    full, batches = runs["interrupted"][base_of(name)], step * BASES[base_of(name)].get("accumulate", 1)
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][batches:], "params": full["params"]},
        tolerance=0.0,
    )
    assert resumed["grad_norms"] == full["grad_norms"][step:]


def test_no_signal_is_refused() -> None:
    from lightning_d9d.callbacks import Preemption

    with pytest.raises(ValueError, match="at least one signal"):
        Preemption(signals=())


def test_under_slurm_the_job_is_requeued_and_lightning_s_own_handler_saves_nothing(tmp_path: Path) -> None:
    """Two SLURM tasks (Lightning's SLURMEnvironment, auto_requeue on): SIGUSR1 to task 1 stops both after the
    step with our checkpoint, rank 0 asks ``scontrol requeue`` for the job once (a stand-in scontrol records
    its arguments), and Lightning's own handler, which would save an ``hpc_ckpt`` from inside the signal
    handler, never runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    config = {
        **RUN,
        "max_steps": 4,
        "schedule_steps": 4,
        "preempt": {"rank": 1, "step": 2, "at": "backward"},
        "ckpt_dir": str(tmp_path / "ckpt"),
        "out": str(tmp_path / "slurm.pt"),
    }
    path = f"{bin_dir}:{os.environ.get('PATH', '')}"
    slurm_tasks(config, tmp_path, nodes=1, per_node=2, env={"PATH": path})
    got = torch.load(config["out"], weights_only=False)
    assert got["environment"] == "SLURMEnvironment"
    assert got["global_step"] == 2 and Path(got["preempted"]).name == "preempted-step=2.ckpt"
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not list(tmp_path.rglob("hpc_ckpt_*"))
