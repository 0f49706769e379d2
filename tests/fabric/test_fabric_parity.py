"""``Fabric(strategy=D9DFabricStrategy(...))`` loops on 1, 2 and 4 CPU processes against one plain PyTorch process
(fp32, 1e-5): losses, gradient norms (before clipping: a wrong gradient scale shows) and parameters after 5 AdamW
steps, for FSDP, tp, cp, tp x FSDP with padded labels, ep (Qwen3-MoE), litgpt's ``GPT``, a ``transformers``
Qwen3 under tp, packed rows of several documents (FSDP, tp, ep, cp, ep x cp, tp x cp; on transformers' Qwen3 under
FSDP with the fused head + loss and under tp and cp, on its Qwen3-MoE under ep and on one process), norm
clipping that bites, FP8 (tensorwise) on a ``transformers`` Qwen3 under FSDP,
and ``fabric.save`` on FSDP resumed by ``fabric.load`` on tp, on one process and on 4 FSDP ranks.

All runs share one launch (``fabric_loop.py --fork``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fabric_loop import BASE, reference_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_trainer_parity import GRAD_NORM_RTOL, TOLERANCE, first_errors

SCRIPT = Path(__file__).with_name("fabric_loop.py")
SAVE_AT = 3
# grouped by devices (one stretch of forked ranks each); a checkpoint is written before a run resumes from it
CASES: dict[str, dict] = {
    # FSDP over 2 ranks, built on meta, set up jointly with its optimizer; saves after step 3
    "fsdp2": {"devices": 2, "dims": {"dp_shard": 2}, "meta_init": True, "save_at": SAVE_AT},
    "tp2": {"devices": 2, "dims": {"tp": 2}, "setup": "module_first"},
    "ep2_moe": {"devices": 2, "dims": {"ep": 2}, "model": "moe"},
    # a threshold below every step's norm: the clipped update must still be the reference's
    "fsdp2_clip": {"devices": 2, "dims": {"dp_shard": 2}, "clip": 0.05},
    "litgpt_fsdp2": {"devices": 2, "dims": {"dp_shard": 2}, "model": "litgpt"},
    # context parallelism: each rank holds its load-balanced half of every sequence
    "cp2": {"devices": 2, "dims": {"cp": 2}},
    # a transformers model handed to fabric.setup whole: the adapter's tp plan from its config
    "hf_tp2": {"devices": 2, "dims": {"tp": 2}, "model": "hf_qwen3"},
    # packed rows (several documents each, position_ids restarting per document): attention per document
    "fsdp2_packed": {"devices": 2, "dims": {"dp_shard": 2}, "packed": True},
    "tp2_packed": {"devices": 2, "dims": {"tp": 2}, "packed": True},
    "ep2_moe_packed": {"devices": 2, "dims": {"ep": 2}, "model": "moe", "packed": True},
    # packed rows on transformers models (positions by keyword): their own per-document masks under the adapter
    "hf_fsdp2_packed": {
        "devices": 2,
        "dims": {"dp_shard": 2},
        "model": "hf_qwen3",
        "packed": True,
        "fused": True,
    },
    "hf_tp2_packed": {"devices": 2, "dims": {"tp": 2}, "model": "hf_qwen3", "packed": True},
    "hf_ep2_moe_packed": {"devices": 2, "dims": {"ep": 2}, "model": "hf_qwen3_moe", "packed": True},
    "hf_cp2_packed": {"devices": 2, "dims": {"cp": 2}, "model": "hf_qwen3", "packed": True, "fused": True},
    # FP8 on a transformers model: against one process with torchao's conversion by hand, each rank's rows on
    # their own (float8 scales over the rows a matmul sees); the weights all-gathered in float8
    "hf_fsdp2_fp8": {"devices": 2, "dims": {"dp_shard": 2, "fp8": "tensorwise"}, "model": "hf_qwen3"},
    # under cp each rank's queries attend every rank's keys of their own document: rows of 16, chunks of 4
    "cp2_packed": {"devices": 2, "dims": {"cp": 2}, "packed": True},
    "cp2_ep2_moe_packed": {"devices": 2, "dims": {"cp": 2, "ep": 2}, "model": "moe", "packed": True},
    "resume_tp2": {"devices": 2, "dims": {"tp": 2}, "resume_from": "fsdp2"},
    # padded labels: the two data ranks hold different numbers of tokens and weigh by them
    "tp2_fsdp2_padded": {"devices": 4, "dims": {"tp": 2, "dp_shard": 2}, "pad": True},
    "ep2_fsdp4_moe": {"devices": 4, "dims": {"ep": 2}, "model": "moe"},
    # cp x tp: this cp rank's queries' document mask handed to tp's sharded heads
    "tp2_cp2_packed": {"devices": 4, "dims": {"tp": 2, "cp": 2}, "packed": True},
    "resume_fsdp4": {"devices": 4, "dims": {"dp_shard": 4}, "resume_from": "fsdp2"},
    "one": {"devices": 1, "dims": {}},
    # packed rows on one process through the whole adapter (transformers' Qwen3-MoE, fused head + loss)
    "hf_one_packed_moe": {"devices": 1, "dims": {}, "model": "hf_qwen3_moe", "packed": True, "fused": True},
    "resume_one": {"devices": 1, "dims": {}, "resume_from": "fsdp2"},
}
DATA_RANKS = {
    "tp2": 1,
    "cp2": 1,
    "cp2_packed": 1,
    "cp2_ep2_moe_packed": 1,
    "tp2_cp2_packed": 1,
    "hf_tp2": 1,
    "hf_tp2_packed": 1,
    "hf_cp2_packed": 1,
    "resume_tp2": 1,
    "tp2_fsdp2_padded": 2,
    "ep2_moe": 2,
    "ep2_fsdp4_moe": 4,
}


def launch_cases(script: Path, cases: dict[str, dict], tmp: Path) -> dict[str, dict]:
    """Every case (on ``BASE``) in one ``script --fork`` launch, in order (a resume names the case whose
    checkpoint it reads): what each saved, by name."""
    configs = []
    for name, case in cases.items():
        config = {**BASE, **case, "out": str(tmp / f"{name}.pt"), "ckpt": str(tmp / f"{name}.ckpt")}
        if "resume_from" in case:
            config["resume_from"] = str(tmp / f"{case['resume_from']}.ckpt")
        configs.append(config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(script), "--fork", json.dumps(configs)]
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(
            f"forked Fabric runs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n"
            f"first error lines of every rank:\n{first_errors(proc.stderr)}"
        )
    return {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return launch_cases(SCRIPT, CASES, tmp_path_factory.mktemp("fabric"))


_references: dict[str, dict] = {}


def reference(name: str) -> dict:
    case = CASES[name]
    dp = DATA_RANKS.get(name, case["devices"])
    moe_dp = dp if case.get("model") == "moe" else 0
    fp8 = case["dims"].get("fp8")
    # float8's reference runs each data rank's rows on its own, as the MoE's does
    fp8_dp = dp if fp8 is not None else 0
    key = repr(
        (case.get("model"), case.get("pad"), case.get("packed"), case.get("clip"), moe_dp, fp8, fp8_dp)
    )
    if key not in _references:
        # one intra-op thread, as the ranks have: the tiny MoE's many small ops ran 25-100x slower on two threads
        # of a busy 2-core box (OpenMP's waiting threads; ep2_moe_packed's reference 24 s against 0.1 s)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _references[key] = reference_run(case, dp)
        finally:
            torch.set_num_threads(threads)
    return _references[key]


def assert_matches(actual: dict, expected: dict, *, first_step: int = 0) -> None:
    assert len(actual["losses"]) == BASE["steps"] - first_step
    torch.testing.assert_close(
        torch.tensor(actual["losses"]),
        torch.tensor(expected["losses"][first_step:]),
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )
    torch.testing.assert_close(
        torch.tensor(actual["grad_norms"]),
        torch.tensor(expected["grad_norms"][first_step:]),
        rtol=GRAD_NORM_RTOL,
        atol=0,
    )
    assert actual["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(actual["params"][name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


@pytest.mark.parametrize("name", [name for name in CASES if "resume_from" not in CASES[name]])
def test_fabric_loop_matches_one_process(name: str, runs: dict) -> None:
    expected = reference(name)
    if "clip" in CASES[name]:
        assert min(expected["grad_norms"]) > CASES[name]["clip"]  # clipping bites on every step
    # the runs trained: the loss fell and the parameters moved well beyond the tolerance
    assert expected["losses"][-1] < expected["losses"][0]
    assert_matches(runs[name], expected)


@pytest.mark.parametrize("name", [name for name in CASES if "resume_from" in CASES[name]])
def test_fabric_resume_on_another_layout_is_exact(name: str, runs: dict) -> None:
    # saved by 2 FSDP ranks after step 3; resumed on tp=2, 4 FSDP ranks and one process: steps 4-5 and the
    # final parameters are those of the uninterrupted run
    assert_matches(runs[name], reference(name), first_step=SAVE_AT)
