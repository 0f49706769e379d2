"""Expert parallelism inside Lightning's loop against a single-process loop (fp32, gloo, 1e-5).

Qwen3-MoE (tiny: 8 experts, top-2, sparse layers around a dense one) with the load-balancing and z losses in
the gradient and the auxiliary-loss-free bias update after every optimizer step (``ExpertLoadBalancing``).
Experts 6 and 7 are excluded by their selection bias, so loads are uneven and some experts receive no token
(``moe/.../load_min`` is 0). 5 optimizer steps: losses, parameters, pre-clip gradient norms. Cases: ep=2 (the
experts split over both data ranks), ep=2 inside dp_shard=4 (experts split over 2, each shard FSDP-sharded over
the other 2; 4 processes), ep=2 x pp=2 (each pipeline stage's experts split over its 2 data ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_trainer_parity import BASE, assert_matches_reference, run_trainer

# Router selection bias on (the bias update needs it); the z-loss on beside the load-balancing loss.
MOE = {"router_selection_bias": True, "router_z_loss_coef": 1e-3}
# rate 0.01: large next to the router probabilities (~1/8), so a missing or doubled update changes routing
BALANCE = {"rate": 0.01, "unchosen": [6, 7]}

CASES: dict[str, dict] = {
    "ep2": {"devices": 2, "dp": 2, "max_steps": 5, "moe": MOE, "moe_balance": BALANCE, "dims": {"ep": 2}},
    # accumulation: the bias moves once per optimizer step, from the load of both micro-steps
    "ep2_accumulate": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "accumulate": 2,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"ep": 2},
    },
    "ep2_dp4": {
        "devices": 4,
        "dp": 4,
        "max_steps": 5,
        "moe": MOE,
        "moe_balance": BALANCE,
        "dims": {"dp_shard": 4, "ep": 2},
    },
    "ep2_pp2": {
        "devices": 4,
        "dp": 2,
        "max_steps": 5,
        "moe": {**MOE, "num_hidden_layers": 4},  # layers 0, 2, 3 sparse; 2 stages of 2
        "moe_balance": BALANCE,
        "dims": {"pp": 2, "ep": 2, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


def config_of(case: str) -> dict:
    return {**BASE, **CASES[case]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """``launched(case)``: the result of ``case``, running all cases of its world size in one launch."""
    results: dict[str, dict] = {}

    def result(case: str) -> dict:
        if case not in results:
            devices = CASES[case]["devices"]
            names = [name for name, config in CASES.items() if config["devices"] == devices]
            tmp: Path = tmp_path_factory.mktemp(f"ep_{devices}")
            results.update(run_trainer([CASES[name] for name in names], tmp, f"ep{devices}", names=names))
        return results[case]

    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_matches_single_process_loop(case: str, launched: Callable[[str], dict]) -> None:
    config = config_of(case)
    actual = launched(case)
    assert_matches_reference(actual, config)
    # the excluded experts got no token: the load of every logged layer has a 0, and is uneven
    loads = actual["moe_load"]
    minima = [value for name, value in loads.items() if name.endswith("load_min")]
    assert minima and all(value == 0 for value in minima), loads
    assert all(value > 0.3 for name, value in loads.items() if name.endswith("load_cv")), loads
