"""``Muon`` and ``StochasticAdamW`` in a Fabric loop under ``D9DFabricStrategy`` (``fabric_optim_loop.py``), against
one plain PyTorch process with the same optimizer: 5 steps with norm clipping that bites on every step
(``fabric.clip_gradients``), a ``fabric.save`` after step 3 and ``fabric.load`` into new ranks.

- Muon (fp32): FSDP (``dp_shard=2``, built on meta, set up jointly with its optimizer), tp=2 (model set up first)
  and Qwen3-MoE at ep=2 (each rank whole experts: the per-expert Newton–Schulz runs on the local stack) within
  1e-5 of one process (losses, gradient norms, parameters); the FSDP checkpoint resumed on tp=2 and on one process
  puts back every parameter, momentum buffer and moment bit for bit and continues within 1e-5.
- StochasticAdamW (``bf16-true``): FSDP (set up jointly: its state, built with the optimizer, is built anew for the
  sharded parameters) and tp=2 with fp32 masters. The ranks' bf16 gradients are one process's up to the order of
  their sums, which flips a stochastic rounding here and there: the bands of
  ``tests/optim/test_stochastic_adamw_parity.py`` (its docstring says why; the update within 8 %, losses 1e-3,
  gradient norms 2e-2). Measured (2-core x86 CPU, torch 2.13): the update 2.1 % (FSDP) and 4.1 % (tp, masters)
  off. Clipping hands its coefficient to the step (``PendingGradientScale``) instead of rewriting the bf16
  gradients: the pending coefficient is clipping's, and the moments are those of one process that clips with
  torch's ``clip_grad_norm_`` (their norms within 2e-2; measured 0.3 %; a step that drops the coefficient puts them
  30x and 1000x off). The FSDP checkpoint resumed on the same layout by new ranks continues bit for bit
  (parameters, moments, step counters: the rounding stream goes on where it stopped); resumed on tp=2 it puts back
  every tensor bit for bit and continues within the bands.

All runs share one launch (``fabric_optim_loop.py --fork``, a stretch per world size).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from fabric_optim_loop import reference_run
from test_fabric_parity import assert_matches, launch_cases
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "optim"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_stochastic_adamw_parity import GRAD_NORM_RTOL, LOSS_RTOL, UPDATE_RTOL, update_difference

from lightning_d9d.fabric.strategy import _check_rebindable, _rebind
from lightning_d9d.optim import StochasticAdamW
from lightning_d9d.strategies.grad_norm import clip_coefficient

SCRIPT = Path(__file__).with_name("fabric_optim_loop.py")
SAVE_AT = 3
CLIP = 0.05  # below every step's gradient norm: clipping bites on every step
MUON = {"optimizer": "muon", "clip": CLIP}
STOCHASTIC = {"optimizer": "stochastic_adamw", "clip": CLIP, "lr": 3e-3}
MOMENT_RTOL = 2e-2  # the moments' norms, as the gradient norms (test_stochastic_adamw_parity.GRAD_NORM_RTOL)
# grouped by devices (one stretch of forked ranks each); the resumes on new ranks, after the checkpoints exist
CASES: dict[str, dict] = {
    "muon_fsdp2": {**MUON, "devices": 2, "dims": {"dp_shard": 2}, "meta_init": True, "save_at": SAVE_AT},
    "muon_tp2": {**MUON, "devices": 2, "dims": {"tp": 2}, "setup": "module_first"},
    "muon_ep2_moe": {**MUON, "devices": 2, "dims": {"ep": 2}, "model": "moe"},
    "stochastic_fsdp2": {
        **STOCHASTIC,
        "devices": 2,
        "dims": {"dp_shard": 2},
        "meta_init": True,
        "save_at": SAVE_AT,
    },
    "stochastic_tp2_masters": {**STOCHASTIC, "devices": 2, "dims": {"tp": 2}, "master_weights": True},
    "muon_fsdp2_on_tp2": {
        **MUON,
        "devices": 2,
        "dims": {"tp": 2},
        "resume_from": "muon_fsdp2",
        "new_ranks": True,
    },
    "stochastic_fsdp2_on_fsdp2": {
        **STOCHASTIC,
        "devices": 2,
        "dims": {"dp_shard": 2},
        "setup": "module_first",
        "resume_from": "stochastic_fsdp2",
    },
    "stochastic_fsdp2_on_tp2": {
        **STOCHASTIC,
        "devices": 2,
        "dims": {"tp": 2},
        "resume_from": "stochastic_fsdp2",
    },
    "muon_fsdp2_on_one": {**MUON, "devices": 1, "dims": {}, "resume_from": "muon_fsdp2"},
}
DATA_RANKS = {name: 1 if "tp" in case["dims"] or case["devices"] == 1 else 2 for name, case in CASES.items()}
TRAINED = [name for name in CASES if "resume_from" not in CASES[name]]
RESUMED = [name for name in CASES if "resume_from" in CASES[name]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return launch_cases(SCRIPT, CASES, tmp_path_factory.mktemp("fabric_optimizers"))


@functools.cache
def _reference(case: str, dp: int) -> dict:
    # one intra-op thread, as the ranks have (test_fabric_parity.reference says why)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_run(json.loads(case), dp)
    finally:
        torch.set_num_threads(threads)


def reference(name: str) -> dict:
    """One process with the optimizer, model and clipping of ``name`` (a resumed run: of the run it resumes)."""
    case = CASES[name]
    trained = case.get("resume_from", name)
    keys = ("optimizer", "model", "clip", "lr", "master_weights")
    setting = {key: CASES[trained][key] for key in keys if key in CASES[trained]}
    dp = DATA_RANKS[trained] if setting.get("model") == "moe" else 1
    return _reference(json.dumps(setting, sort_keys=True), dp)


def assert_same_tensors(actual: dict, expected: dict) -> None:
    """Parameters, optimizer state (every tensor) and group settings equal bit for bit."""
    assert actual["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        assert actual["params"][name].dtype == value.dtype and torch.equal(actual["params"][name], value), (
            name
        )
    assert actual["state"].keys() == expected["state"].keys()
    for name, entries in expected["state"].items():
        assert actual["state"][name].keys() == entries.keys(), name
        for key, value in entries.items():
            got = actual["state"][name][key]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{key} of {name}"
    assert actual["groups"] == expected["groups"]


def stochastic_mismatch(actual: dict, expected: dict, first_step: int = 0) -> str | None:
    """Why a StochasticAdamW run is not one process's within test_stochastic_adamw_parity's bands, or None."""
    difference = update_difference(actual, expected, expected["initial"])
    if difference > UPDATE_RTOL:
        return f"updates differ by {difference:.1%} of the update"
    for step, (a, e) in enumerate(zip(actual["losses"], expected["losses"][first_step:], strict=True)):
        if abs(a - e) > LOSS_RTOL * e:
            return f"loss of step {first_step + step}: {a} vs {e}"
    for step, (a, e) in enumerate(
        zip(actual["grad_norms"], expected["grad_norms"][first_step:], strict=True)
    ):
        if abs(a - e) > GRAD_NORM_RTOL * e:
            return f"gradient norm of step {first_step + step}: {a} vs {e}"
    return None


def moment_norms(run: dict) -> torch.Tensor:
    """The norms of all first and of all second moments (fp32)."""
    return torch.stack(
        [
            torch.cat([state[key].float().flatten() for state in run["state"].values()]).norm()
            for key in ("exp_avg", "exp_avg_sq")
        ]
    )


@pytest.mark.parametrize("name", [name for name in TRAINED if CASES[name]["optimizer"] == "muon"])
def test_muon_in_a_fabric_loop_matches_one_process(name: str, runs: dict) -> None:
    expected = reference(name)
    assert min(expected["grad_norms"]) > CLIP  # clipping bites on every step
    assert expected["losses"][-1] < expected["losses"][0]
    run = runs[name]
    assert_matches(run, expected)
    # every parameter has state: a momentum buffer for the blocks' matrices, AdamW's moments for the rest
    assert run["final"]["state"].keys() == expected["state"].keys() == expected["params"].keys()
    for param, state in run["final"]["state"].items():
        assert state.keys() == expected["state"][param].keys(), param


@pytest.mark.parametrize("name", [name for name in RESUMED if CASES[name]["optimizer"] == "muon"])
def test_a_muon_checkpoint_resumes_on_another_layout(name: str, runs: dict) -> None:
    saved_by = CASES[name]["resume_from"]
    assert_same_tensors(runs[name]["loaded"], runs[saved_by]["saved"])
    assert_matches(runs[name], reference(name), first_step=SAVE_AT)


@pytest.mark.parametrize("name", [name for name in TRAINED if CASES[name]["optimizer"] == "stochastic_adamw"])
def test_stochastic_adamw_in_a_fabric_loop_is_one_process_up_to_rounding(name: str, runs: dict) -> None:
    expected, run = reference(name), runs[name]
    assert min(expected["grad_norms"]) > CLIP
    assert {value.dtype for value in run["final"]["params"].values()} == {torch.bfloat16}
    problem = stochastic_mismatch(run, expected)
    assert problem is None, problem
    # clipping's coefficient waited in the optimizer for its step, and the step applied it: the moments are
    # those of the clipped gradients
    coefficients = clip_coefficient(torch.tensor(run["grad_norms"]), CLIP)
    torch.testing.assert_close(torch.tensor(run["pending"]), coefficients, rtol=1e-6, atol=0)
    torch.testing.assert_close(moment_norms(run["final"]), moment_norms(expected), rtol=MOMENT_RTOL, atol=0)


def test_a_stochastic_adamw_checkpoint_resumes_exactly_on_its_layout(runs: dict) -> None:
    """New ranks on FSDP, from step 3: steps 4-5 and every final tensor are the uninterrupted run's, bit for bit."""
    full, resumed = runs["stochastic_fsdp2"], runs["stochastic_fsdp2_on_fsdp2"]
    assert_same_tensors(resumed["loaded"], full["saved"])
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["grad_norms"] == full["grad_norms"][SAVE_AT:]
    assert_same_tensors(resumed["final"], full["final"])
    assert {int(state["step"]) for state in resumed["final"]["state"].values()} == {5}


def test_a_stochastic_adamw_checkpoint_resumes_on_another_layout(runs: dict) -> None:
    """On tp=2: every tensor put back bit for bit, then one process's steps within the bands."""
    resumed = runs["stochastic_fsdp2_on_tp2"]
    assert_same_tensors(resumed["loaded"], runs["stochastic_fsdp2"]["saved"])
    problem = stochastic_mismatch(resumed, reference("stochastic_fsdp2_on_tp2"), first_step=SAVE_AT)
    assert problem is None, problem


def test_stochastic_adamw_set_up_with_its_model_takes_state_for_the_new_parameters() -> None:
    """``fabric.setup(model, StochasticAdamW(model.parameters()))``: the optimizer built its state (and masters)
    for the parameters sharding then replaces; it is given state for the new ones, as if built over them. One
    that stepped is still refused."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    optimizer = StochasticAdamW(model.parameters(), master_weights=True)
    names = {id(p): n for n, p in model.named_parameters()}
    _check_rebindable(optimizer, names)
    model[0] = nn.Linear(4, 3).to(
        torch.bfloat16
    )  # new parameters under the same names, as a plan leaves them
    _rebind(optimizer, names, model)
    params = list(model.parameters())
    assert list(optimizer.state) == params
    for param in params:
        assert torch.equal(optimizer.state[param]["master"], param.float())
        assert int(optimizer.state[param]["step"]) == 0
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="set it up before its first step"):
        _check_rebindable(optimizer, names)
