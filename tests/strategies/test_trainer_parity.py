"""Trainer(strategy=D9DStrategy(...)) against a plain single-process loop: losses and parameters (fp32, 1e-5).

Each case is a real multi-process run launched by Lightning (the script re-executes itself for every rank).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_launched
from reference import reference_run

from lightning_d9d.models import Qwen3Config

SCRIPT = Path(__file__).with_name("trainer_script.py")
TOLERANCE = 1e-5
# Measured: at most 2.1e-7 relative between the Trainer's and the reference's fp32 gradient norms.
GRAD_NORM_RTOL = 1e-6
# lr 1e-3: AdamW turns summation-order differences of near-zero gradients into parameter differences
# proportional to lr (measured, worst case over the fp32 cases: 1.2e-5 at lr 3e-3, 4.1e-6 at lr 1e-3).
BASE = {"seed": 7, "seq_len": 16, "global_batch": 8, "lr": 1e-3, "steps_per_epoch": 16, "schedule_steps": 8}


def run_trainer(
    config: dict | list[dict],
    tmp_path: Path,
    name: str,
    names: list[str] | None = None,
    fork: bool = False,
) -> Any:
    """Lightning's own launcher when ``config["launcher"] == "lightning"``; else, with ``fork``, ranks forked
    by ``trainer_script.py --fork`` after its imports (torchrun's environment: Lightning takes them for
    torchrun's); else torchrun (which starts all ranks at once; Lightning's launcher waits 1-5 s before each
    extra rank). torchrun's ranks are fresh interpreters that each import torch and Lightning (about 7 s of CPU
    each, 14-20 s of a 2-4 rank launch on 2 cores, against 1-4 s of training): ``fork`` runs the same
    ``run_all`` on the same configs without that cost.

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
    if fork and config.get("launcher") != "lightning" and config["devices"] > 1:
        command[2:2] = ["--fork"]
        command[-1] = json.dumps(configs)
    elif config.get("launcher") != "lightning" and config["devices"] > 1:
        command[1:1] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={config['devices']}",
        ]
    proc = run_launched(command, cwd=tmp_path, env=env, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(
            f"trainer run {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n"
            f"first error lines of every rank:\n{first_errors(proc.stderr)}"
        )
    results = {
        label: torch.load(one["out"], weights_only=False) for label, one in zip(labels, configs, strict=True)
    }
    return results if batch else results[labels[0]]


def first_errors(stderr: str, limit: int = 40) -> str:
    """The lines that name a failure (Python errors, C++ aborts such as gloo's enforce messages), in order: the
    tail of a 4-rank failure is the other ranks' tracebacks about the lost peer, not the first rank's cause."""
    markers = ("Error", "error:", "terminate called", "what():", "enforce", "Exception", "Signal ")
    hits = [line for line in stderr.splitlines() if any(marker in line for marker in markers)]
    return "\n".join(hits[:limit])


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


def assert_same_grad_norms(actual: dict, expected: dict, rtol: float = GRAD_NORM_RTOL) -> None:
    """The gradient norm before clipping on every optimizer step: unlike losses and AdamW's (nearly
    scale-free) updates, it shows a gradient that is off by a constant factor, and clipping cannot hide it."""
    assert len(actual["grad_norms"]) == len(expected["grad_norms"])
    for step, (a, e) in enumerate(zip(actual["grad_norms"], expected["grad_norms"], strict=True)):
        assert abs(a - e) <= rtol * e, f"gradient norm of step {step}: {a} vs {e}"


# bf16 bands below were measured at lr 3e-3 (larger updates: further from the untrained run).
BF16 = {"max_steps": 5, "lr": 3e-3}
# 14 steps of 4-batch epochs, checkpoints every 4 and every 7 steps: step 4 ends an epoch, step 7 is in the
# middle of one (the acceptance's "7 steps, stop, resume to 14"); the LR schedule spans all 14 steps.
RESUMABLE = {"max_steps": 14, "schedule_steps": 14, "steps_per_epoch": 4, "save_every": [4, 7]}

# Runs of one world size share one launch (process start-up is most of the cost of these small runs).
LAUNCHES: dict[str, dict[str, dict]] = {
    "one_process": {
        "one_process": {"devices": 1, "dp": 1, **RESUMABLE},
        "bf16-mixed_one_process": {"devices": 1, "dp": 1, **BF16, "precision": "bf16-mixed"},
        "bf16-true_one_process": {"devices": 1, "dp": 1, **BF16, "precision": "bf16-true"},
        # no FSDP on the one rank: plain parameters, clipping, and bf16-mixed as autocast
        "one_process_without_fsdp": {
            "devices": 1,
            "dp": 1,
            "max_steps": 5,
            "clip": 0.05,
            "save_every": 3,
            "dims": {"fsdp_on_one_rank": False},
        },
        "bf16-mixed_one_process_without_fsdp": {
            "devices": 1,
            "dp": 1,
            **BF16,
            "precision": "bf16-mixed",
            "dims": {"fsdp_on_one_rank": False},
        },
        # Qwen3-MoE without FSDP: its grouped GEMMs cast under autocast like a Linear
        "moe_one_process_without_fsdp": {
            "devices": 1,
            "dp": 1,
            "max_steps": 3,
            "moe": {"router_z_loss_coef": 1e-3},
            "dims": {"fsdp_on_one_rank": False},
        },
        "bf16-mixed_moe_one_process_without_fsdp": {
            "devices": 1,
            "dp": 1,
            **BF16,
            "precision": "bf16-mixed",
            "moe": {"router_z_loss_coef": 1e-3},
            "dims": {"fsdp_on_one_rank": False},
        },
    },
    "lightning_launcher": {
        "fsdp2": {"devices": 2, "dp": 2, "max_steps": 5, "validate": True, "launcher": "lightning"},
    },
    "two_processes": {
        # an unchanged LightningModule: eager init (differently seeded per rank), default plan
        "plain_module_fsdp2": {"devices": 2, "dp": 2, "max_steps": 3, "plain_module": True},
        # without clipping: a clip threshold that bites rescales away any gradient-scale error
        "fsdp2_accumulate": {"devices": 2, "dp": 2, "max_steps": 5, "accumulate": 2},
        "fsdp2_accumulate_clip": {"devices": 2, "dp": 2, "max_steps": 5, "accumulate": 2, "clip": 0.05},
        # padded labels: ranks hold different token counts, and the loss is still the global token mean. lr
        # 3e-4: embedding rows seen only before padding get near-zero gradients, whose summation-order noise
        # AdamW scales up to ~lr (2e-5 at lr 1e-3, while losses agree to 5e-7 and gradient norms to 7e-8).
        "fsdp2_padded": {"devices": 2, "dp": 2, "max_steps": 5, "pad": True, "lr": 3e-4, "validate": True},
        # Qwen3-MoE (2 sparse layers around a dense one, 8 experts, top-2, load-balancing + z loss): experts
        # sharded by FSDP, each rank's router losses in its gradient once
        "moe_fsdp2": {"devices": 2, "dp": 2, "max_steps": 5, "moe": {"router_z_loss_coef": 1e-3}},
        "moe_fsdp2_accumulate": {"devices": 2, "dp": 2, "max_steps": 3, "accumulate": 2, "moe": {}},
        "fsdp2_resumable": {"devices": 2, "dp": 2, **RESUMABLE},
        # 2 optimizer steps per epoch: the checkpoint of step 3 is 2 batches into the second epoch
        "fsdp2_resumable_accumulate": {
            "devices": 2,
            "dp": 2,
            "accumulate": 2,
            "max_steps": 4,
            "steps_per_epoch": 4,
            "save_every": 3,
        },
        "bf16-mixed": {"devices": 2, "dp": 2, **BF16, "precision": "bf16-mixed"},
        "bf16-true": {"devices": 2, "dp": 2, **BF16, "precision": "bf16-true"},
        "activation_checkpointing": {
            "devices": 2,
            "dp": 2,
            "max_steps": 3,
            "dims": {"activation_checkpointing": True},
            "record_recompute": True,  # the aten ops the recompute ran (assert_recompute_policy)
        },
        "selective_activation_checkpointing": {
            "devices": 2,
            "dp": 2,
            "max_steps": 3,
            "dims": {"activation_checkpointing": "selective"},
            "record_recompute": True,  # the aten ops the recompute ran (assert_recompute_policy)
        },
        # last: inductor's compile time is the largest cost here, so a 1-layer model
        "compile": {
            "devices": 2,
            "dp": 2,
            "max_steps": 3,
            "model": {"num_hidden_layers": 1},
            "dims": {"compile": True},
        },
    },
    "four_processes": {
        "hsdp_2x2": {"devices": 4, "dp": 4, "max_steps": 5, "dims": {"dp_replicate": 2, "dp_shard": 2}},
        "hsdp_2x2_padded_accumulate": {
            "devices": 4,
            "dp": 4,
            "max_steps": 3,
            "accumulate": 2,
            "pad": True,
            "dims": {"dp_replicate": 2, "dp_shard": 2},
        },
    },
}
GROUP_OF = {case: group for group, cases in LAUNCHES.items() for case in cases}
FP32_CASES = sorted(case for case in GROUP_OF if "bf16" not in case)


def config_of(case: str) -> dict:
    return {**BASE, **LAUNCHES[GROUP_OF[case]][case]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoints / case``: the checkpoint directory of a case with ``save_every``."""
    return tmp_path_factory.mktemp("checkpoints")


# The 2- and 4-process groups share one launch (each launch pays the script's imports, about 5 s of a 2-core
# machine, before it forks): a stretch of 2 new ranks, one of 4, then one of 2 more new ranks that resume the
# 2-process checkpoints (test_resume_continues_at_the_next_batch[2]: other processes than those that saved).
FORKED_GROUPS = ("two_processes", "four_processes")


def resumed_name(case: str, step: int) -> str:
    return f"{case}_from_{step}"


def resumed_config(case: str, step: int, checkpoints: Path) -> dict:
    return {**config_of(case), "save_every": 0, "resume_from": str(checkpoints / case / f"step={step}.ckpt")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> Callable[[str], dict]:
    """``launched(case)``: the result of ``case`` (or of a 2-process resume, ``resumed_name``), running its
    whole launch on first use."""
    launches: dict[str, dict | AssertionError] = {}
    resumes = {resumed_name(case, step): (case, step) for case, step in RESUMES[2]}

    def result(case: str) -> dict:
        group = "forked" if case in resumes or GROUP_OF[case] in FORKED_GROUPS else GROUP_OF[case]
        if group not in launches:
            members = FORKED_GROUPS if group == "forked" else (group,)
            configs = {
                name: {**config, "ckpt_dir": str(checkpoints / name)} if config.get("save_every") else config
                for member in members
                for name, config in LAUNCHES[member].items()
            }
            if group == "forked":
                configs.update({name: resumed_config(*saved, checkpoints) for name, saved in resumes.items()})
            tmp = tmp_path_factory.mktemp(group)
            try:
                launches[group] = run_trainer(
                    list(configs.values()), tmp, group, names=list(configs), fork=True
                )
            except AssertionError as error:  # every case of the group reports it; none relaunches
                launches[group] = error
        outcome = launches[group]
        if isinstance(outcome, AssertionError):
            raise outcome
        return outcome[case]

    return result


def launcher_by_world_size(
    cases: dict[str, dict], tmp_path_factory: pytest.TempPathFactory, prefix: str
) -> Callable[[str], dict]:
    """``launched(case)`` for a test module's ``cases`` (each on more than one process): the result of ``case``,
    running every case in one launch on first use, one stretch of forked ranks per world size (``devices``),
    each stretch in dict order (a saver before the case resuming from it). One launch, not one per world size:
    each launch pays the script's imports (about 5 s of a 2-core machine) before it forks. A case with
    ``save_every`` saves to ``launched.checkpoints / case``; a relative ``resume_from`` is read from there. A
    failed launch fails every case without relaunching."""
    checkpoints = tmp_path_factory.mktemp(f"{prefix}_checkpoints")
    launches: dict[str, dict | AssertionError] = {}

    def placed(config: dict, name: str) -> dict:
        if config.get("save_every"):
            config = {**config, "ckpt_dir": str(checkpoints / name)}
        if config.get("resume_from"):
            config = {**config, "resume_from": str(checkpoints / config["resume_from"])}
        return config

    def result(case: str) -> dict:
        if "all" not in launches:
            # grouped by world size (a stable sort keeps dict order within each): a stretch per world size
            names = sorted(cases, key=lambda name: cases[name]["devices"])
            assert all(cases[name]["devices"] > 1 for name in names), "forked launches need 2+ processes"
            tmp = tmp_path_factory.mktemp(prefix)
            configs = [placed(cases[name], name) for name in names]
            try:
                launches["all"] = run_trainer(configs, tmp, prefix, names=names, fork=True)
            except AssertionError as error:
                launches["all"] = error
        outcome = launches["all"]
        if isinstance(outcome, AssertionError):
            raise outcome
        return outcome[case]

    result.checkpoints = checkpoints  # type: ignore[attr-defined]
    return result


# SGD runs with every step's gradients recorded (``record_grads``), measured (fp32, gloo, 2 cores): gradients
# within 1.1e-6 of the largest entry of their tensor, parameters after 5 SGD steps within 3.7e-9 (an ulp of the
# largest). Where AdamW's division by ``sqrt(v) + eps`` scales up the rounding of gradient entries near eps past
# the 1e-5 band, a case runs SGD and is held to these instead: a gradient off by 1e-4 of itself fails them.
GRAD_RTOL = 1e-5
SGD_PARAM_TOLERANCE = 2e-8


def assert_same_step_grads(actual: dict, expected: dict) -> None:
    """Every optimizer step's gradients within ``GRAD_RTOL`` of their tensor's largest entry, and (SGD: no
    amplification) the parameters within ``SGD_PARAM_TOLERANCE``."""
    assert len(actual["step_grads"]) == len(expected["step_grads"])
    for step, (ours, theirs) in enumerate(zip(actual["step_grads"], expected["step_grads"], strict=True)):
        assert ours.keys() == theirs.keys()
        for name, grad in theirs.items():
            error = (ours[name] - grad).abs().max().item()
            assert error <= GRAD_RTOL * grad.abs().max().item(), (
                f"step {step + 1}: gradient of {name} {error:.3g} off (largest entry {grad.abs().max():.3g})"
            )
    worst = max(
        ((actual["params"][name] - param).abs().max().item(), name)
        for name, param in expected["params"].items()
    )
    assert worst[0] <= SGD_PARAM_TOLERANCE, f"largest parameter difference {worst[0]:.3g} in {worst[1]}"


def assert_matches_reference(actual: dict, config: dict) -> None:
    """An fp32 Trainer run against the single-process loop: losses, parameters, pre-clip gradient norms, the
    validation loss; and a clip threshold must bite on every step, or the case tests nothing about clipping.
    With ``record_grads`` (an SGD case) also every step's gradients and the parameters, tightly."""
    expected = reference_run(config)
    if config.get("record_grads"):
        assert config.get("optimizer") == "sgd", "record_grads cases run SGD (AdamW amplifies rounding)"
        assert len(expected["step_grads"]) == config["max_steps"]
        assert_same_step_grads(actual, expected)
    assert_same_training(actual, expected)
    assert_same_grad_norms(actual, expected)
    assert actual["param_dtypes"] == ["torch.float32"]
    if config.get("validate"):
        assert abs(actual["val_loss"] - expected["val_loss"]) <= TOLERANCE
    if config.get("clip"):
        assert min(expected["grad_norms"]) > config["clip"], expected["grad_norms"]


# Element-wise ops of every block (RMSNorm, SwiGLU, RoPE, residual adds): both kinds recompute them.
ELEMENTWISE = {"aten.rsqrt.default", "aten.silu.default", "aten.mul.Tensor", "aten.add.Tensor"}
# The ops whose outputs selective checkpointing keeps (and full recompute runs again).
MATMULS_AND_ATTENTION = (
    "aten.mm.",
    "aten.addmm.",
    "aten.bmm.",
    "aten._grouped_mm.",
    "aten._scaled_dot_product",
)


def assert_recompute_policy(actual: dict, config: dict) -> None:
    """The recompute of a run with ``record_recompute`` ran the policy asked for: full recompute runs the
    matmuls and attention again, selective only the element-wise ops (fp32 on CPU, both give the same numbers:
    only the ops that ran tell them apart)."""
    ops = set(actual["recomputed_ops"])
    assert ops >= ELEMENTWISE, f"the recompute did not run {sorted(ELEMENTWISE - ops)}: {sorted(ops)}"
    expensive = {op for op in ops if op.startswith(MATMULS_AND_ATTENTION)}
    if config["dims"]["activation_checkpointing"] == "selective":
        assert not expensive, f"selective checkpointing recomputed {sorted(expensive)}"
    else:
        assert "aten.mm.default" in expensive, (
            f"full checkpointing did not recompute the matmuls: {sorted(ops)}"
        )


@pytest.mark.parametrize("case", FP32_CASES)
def test_matches_single_process_loop(case: str, launched: Callable[[str], dict]) -> None:
    config = config_of(case)
    actual = launched(case)
    assert_matches_reference(actual, config)
    layers = Qwen3Config.tiny(**config.get("model", {})).num_hidden_layers
    options = config.get("dims", {})
    assert actual["compiled_modules"] == (layers if options.get("compile") else 0)
    assert actual["checkpointed_modules"] == (layers if options.get("activation_checkpointing") else 0)
    if config.get("record_recompute"):
        assert_recompute_policy(actual, config)
    assert actual["dtensor_params"] == options.get("fsdp_on_one_rank", True)


# (uninterrupted run, step of the checkpoint to resume from): mid-epoch on 1 and 2 processes (7 of 14 steps),
# with gradient accumulation, and at an epoch boundary.
RESUMES = {
    1: [("one_process", 7), ("one_process_without_fsdp", 3)],
    2: [("fsdp2_resumable", 7), ("fsdp2_resumable", 4), ("fsdp2_resumable_accumulate", 3)],
}


@pytest.mark.parametrize("devices", sorted(RESUMES))
def test_resume_continues_at_the_next_batch(
    devices: int, launched: Callable[[str], dict], checkpoints: Path, tmp_path: Path
) -> None:
    """Resumed runs equal the uninterrupted run exactly: without a resumable data position Lightning would
    restart a mid-epoch checkpoint at batch 0 of that epoch (it replays batches it has trained on)."""
    uninterrupted = {case: launched(case) for case, _ in RESUMES[devices]}
    configs = [resumed_config(case, step, checkpoints) for case, step in RESUMES[devices]]
    names = [resumed_name(case, step) for case, step in RESUMES[devices]]
    if devices == 1:  # a launch of its own: a new process after the one that saved
        resumed = run_trainer(configs, tmp_path, "resumed", names=names, fork=True)
    else:  # in the 2- and 4-process launch, on 2 new ranks after those that saved
        resumed = {name: launched(name) for name in names}
    for (case, step), name, config in zip(RESUMES[devices], names, configs, strict=True):
        consumed = step * config.get("accumulate", 1)
        full = uninterrupted[case]
        assert_same_training(
            {"losses": resumed[name]["losses"], "params": resumed[name]["params"]},
            {"losses": full["losses"][consumed:], "params": full["params"]},
            tolerance=0.0,
        )
        assert resumed[name]["grad_norms"] == full["grad_norms"][step:]
        # and the uninterrupted run itself is the single-process loop
        expected = reference_run(config_of(case))
        assert_same_training(full, expected)
        assert_same_grad_norms(full, expected)


# bf16 runs against the same loop in bf16 (reference.py: a bf16 compute copy of fp32 parameters for
# bf16-mixed, a bf16 model for bf16-true). Measured: one process equals it exactly (parameters, losses);
# two processes differ from one by the order in which bf16 gradients are summed: 2.1 % (mixed) and 2.0 %
# (true) of the parameter update, 3.5e-4 / 2.4e-4 in the loss, 4.5e-4 / 2.3e-3 relative in the gradient norm.
# The bands below are 2.5-4x those; an untrained run (lr=0) or one at twice the lr is 100 % off in the update.
BF16_UPDATE_RTOL = 0.05
BF16_LOSS_TOLERANCE = 1e-3
BF16_GRAD_NORM_RTOL = 1e-2


def bf16_mismatch(
    actual: dict, expected: dict, initial: dict[str, torch.Tensor], update_rtol: float = BF16_UPDATE_RTOL
) -> str | None:
    """Why ``actual`` is not ``expected`` within the bf16 bands (``update_rtol``: of the update), or None."""

    def update(run: dict) -> torch.Tensor:
        return torch.cat([(run["params"][n].float() - initial[n].float()).flatten() for n in initial])

    reference_update = update(expected)
    relative = float((update(actual) - reference_update).norm() / reference_update.norm())
    if relative > update_rtol:
        return f"parameter updates differ by {relative:.1%} of the reference update"
    for step, (a, e) in enumerate(zip(actual["losses"], expected["losses"], strict=True)):
        if abs(a - e) > BF16_LOSS_TOLERANCE:
            return f"loss of step {step}: {a} vs {e}"
    for step, (a, e) in enumerate(zip(actual["grad_norms"], expected["grad_norms"], strict=True)):
        if abs(a - e) > BF16_GRAD_NORM_RTOL * e:
            return f"gradient norm of step {step}: {a} vs {e}"
    return None


@pytest.mark.parametrize(
    "case", ["bf16-mixed_one_process_without_fsdp", "bf16-mixed_moe_one_process_without_fsdp"]
)
def test_bf16_mixed_without_fsdp_autocasts(case: str, launched: Callable[[str], dict]) -> None:
    """One rank without FSDP: plain fp32 parameters and the forward under bf16 autocast, equal to a loop that
    autocasts; within the bf16 bands of FSDP's casting (a bf16 copy of every parameter: the embedding and the
    norms compute in bf16 under autocast too); and not fp32 training, so autocast did run. Dense and MoE."""
    config = config_of(case)
    actual = launched(case)
    assert actual["param_dtypes"] == ["torch.float32"] and not actual["dtensor_params"]
    expected = reference_run(config)
    assert_same_training(actual, expected)
    assert_same_grad_norms(actual, expected)
    fsdp_casting = reference_run({**config, "dims": {}})
    initial = reference_run({**config, "max_steps": 0})["params"]
    mismatch = bf16_mismatch(actual, fsdp_casting, initial)
    assert mismatch is None, mismatch
    fp32 = reference_run({**config, "precision": "32-true", "dims": {}})
    gap = max(abs(a - b) for a, b in zip(actual["losses"], fp32["losses"], strict=True))
    assert gap > 10 * TOLERANCE, gap


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_matches_a_bf16_loop(precision: str, launched: Callable[[str], dict]) -> None:
    config = config_of(precision)
    expected = reference_run(config)
    stored = "torch.float32" if precision == "bf16-mixed" else "torch.bfloat16"
    one_process = launched(f"{precision}_one_process")
    assert one_process["param_dtypes"] == [stored]
    assert_same_training(one_process, expected)
    assert_same_grad_norms(one_process, expected)
    two_processes = launched(precision)
    assert two_processes["param_dtypes"] == [stored]
    initial = reference_run({**config, "max_steps": 0})["params"]
    mismatch = bf16_mismatch(two_processes, expected, initial)
    assert mismatch is None, mismatch
    # the bands can fail: a run that does not train, and one that trains twice as fast, are outside them
    for lr_factor in (0.0, 2.0):
        wrong = reference_run({**config, "lr": config["lr"] * lr_factor})
        assert bf16_mismatch(wrong, expected, initial) is not None, f"lr x{lr_factor} passed"
