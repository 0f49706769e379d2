"""Trainer(strategy=D9DStrategy(...)) against a plain single-process loop: losses and parameters (fp32, 1e-5).

Each case is a real multi-process run launched by Lightning (the script re-executes itself for every rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import reference_run

SCRIPT = Path(__file__).with_name("trainer_script.py")
TOLERANCE = 1e-5
BASE = {"seed": 7, "seq_len": 16, "global_batch": 8, "lr": 3e-3, "steps_per_epoch": 16, "schedule_steps": 8}


def run_trainer(config: dict | list[dict], tmp_path: Path, name: str, names: list[str] | None = None) -> Any:
    """Lightning's own launcher when ``config["launcher"] == "lightning"``, else torchrun (which starts all
    ranks at once; Lightning's launcher waits 1-5 s before each extra rank).

    A list of configs (same world size) runs in one launch and returns ``{name: result}``.
    """
    batch = isinstance(config, list)
    configs = config if isinstance(config, list) else [config]
    labels = names if names is not None else [name]
    configs = [
        {**BASE, **one, "out": str(tmp_path / f"{name}_{label}.pt")}
        for one, label in zip(configs, labels, strict=True)
    ]
    config = configs[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(SCRIPT), json.dumps(configs if batch else config)]
    if config.get("launcher") != "lightning" and config["devices"] > 1:
        command[1:1] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={config['devices']}",
        ]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(
            f"trainer run {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    results = {
        label: torch.load(one["out"], weights_only=False) for label, one in zip(labels, configs, strict=True)
    }
    return results if batch else results[labels[0]]


def assert_same_training(actual: dict, expected: dict, tolerance: float = TOLERANCE) -> None:
    assert len(actual["losses"]) == len(expected["losses"])
    for step, (a, e) in enumerate(zip(actual["losses"], expected["losses"], strict=True)):
        assert abs(a - e) <= tolerance, f"loss of micro-batch {step}: {a} vs {e}"
    assert actual["params"].keys() == expected["params"].keys()
    worst = max(
        ((actual["params"][n] - expected["params"][n].float()).abs().max().item(), n)
        for n in expected["params"]
    )
    assert worst[0] <= tolerance, f"largest parameter difference {worst[0]:.3g} in {worst[1]}"


CASES = {
    "one_process": {"devices": 1, "dp": 1, "max_steps": 5},
    "fsdp2": {"devices": 2, "dp": 2, "max_steps": 5, "validate": True, "launcher": "lightning"},
    "hsdp_2x2": {"devices": 4, "dp": 4, "max_steps": 5, "dims": {"dp_replicate": 2, "dp_shard": 2}},
    # an unchanged LightningModule: eager init (differently seeded per rank), default plan
    "plain_module_fsdp2": {"devices": 2, "dp": 2, "max_steps": 3, "plain_module": True},
    "fsdp2_accumulate_clip": {"devices": 2, "dp": 2, "max_steps": 5, "accumulate": 2, "clip": 0.05},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_single_process_loop(case: str, tmp_path: Path) -> None:
    config = {**BASE, **CASES[case]}
    actual = run_trainer(config, tmp_path, case)
    expected = reference_run(config)
    assert_same_training(actual, expected)
    assert actual["param_dtypes"] == ["torch.float32"]
    if config.get("validate"):
        assert abs(actual["val_loss"] - expected["val_loss"]) <= TOLERANCE
    if config.get("clip"):
        # the threshold must bite on every step, otherwise this case tests nothing about clipping
        assert min(expected["grad_norms"]) > config["clip"], expected["grad_norms"]


def test_resume_is_exact(tmp_path: Path) -> None:
    common = {
        **BASE,
        "devices": 2,
        "dp": 2,
        "max_steps": 8,
        "steps_per_epoch": 4,
        "save_every": 4,
        "ckpt_dir": str(tmp_path / "ckpt"),
    }
    uninterrupted = run_trainer(common, tmp_path, "uninterrupted")
    checkpoint = tmp_path / "ckpt" / "step=4.ckpt"
    assert (checkpoint / "meta.pt").is_file() and (checkpoint / ".metadata").is_file()
    resumed = run_trainer({**common, "save_every": 0, "resume_from": str(checkpoint)}, tmp_path, "resumed")
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": uninterrupted["losses"][4:], "params": uninterrupted["params"]},
        tolerance=0.0,
    )
    # and the uninterrupted run itself is the single-process loop
    assert_same_training(uninterrupted, reference_run(common))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_close_to_fp32(precision: str, tmp_path: Path) -> None:
    config = {**BASE, "devices": 2, "dp": 2, "max_steps": 5, "precision": precision}
    actual = run_trainer(config, tmp_path, precision)
    expected = reference_run(config)
    stored = "torch.float32" if precision == "bf16-mixed" else "torch.bfloat16"
    assert actual["param_dtypes"] == [stored]
    for a, e in zip(actual["losses"], expected["losses"], strict=True):
        assert abs(a - e) <= 0.03 * e, (actual["losses"], expected["losses"])
    assert actual["losses"][-1] < actual["losses"][0]
