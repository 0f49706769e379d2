"""Several nodes, shown on one machine: two ``torchrun`` node processes (``--nnodes 2 --node-rank 0/1``, a static
rendezvous on localhost, gloo) run ``Trainer(num_nodes=2, devices=2, strategy=D9DStrategy(dp_replicate=2,
dp_shard=2))`` (replicas across the nodes, shards within) against the single-process loop (fp32, 1e-5); its
mid-epoch checkpoint resumes on one node of 4 processes exactly where the uninterrupted run was; and the same
two-node run started as SLURM would start it (4 tasks with Lightning's SLURM variables, no torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import free_port
from reference import reference_run
from test_trainer_parity import BASE, SCRIPT, assert_same_grad_norms, assert_same_training, first_errors

STEPS, SAVED_AT = 6, 3
TWO_NODES = {
    **BASE,
    "devices": 2,
    "num_nodes": 2,
    "dp": 4,
    "dims": {"dp_replicate": 2, "dp_shard": 2},
    "max_steps": STEPS,
    "schedule_steps": STEPS,
    "steps_per_epoch": 4,  # the checkpoint of step 3 is mid-epoch
}
# torchrun's variables, which a test process may carry from its own launcher: each launch sets its own
LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)


def clean_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env = {key: value for key, value in env.items() if not key.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def wait_all(processes: list[subprocess.Popen[str]], name: str) -> None:
    outputs = [process.communicate(timeout=600) for process in processes]
    failed = [i for i, process in enumerate(processes) if process.returncode != 0]
    if failed:
        stderr = "\n".join(outputs[i][1] for i in failed)
        raise AssertionError(f"{name}: processes {failed} failed:\n{stderr[-6000:]}\n{first_errors(stderr)}")


def torchrun_nodes(config: dict[str, Any], tmp_path: Path) -> None:
    """One ``torchrun`` per node, both on this machine, meeting at a static rendezvous on localhost."""
    port = free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                f"--nproc-per-node={config['devices']}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(SCRIPT),
                json.dumps(config),
            ],
            cwd=tmp_path,
            env=clean_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    wait_all(processes, "torchrun --nnodes 2")


def slurm_tasks(
    config: dict[str, Any],
    tmp_path: Path,
    *,
    nodes: int = 2,
    per_node: int = 2,
    env: dict[str, str] | None = None,
) -> None:
    """The tasks of ``srun --nodes {nodes} --ntasks-per-node {per_node}``, each told its place by SLURM's
    variables only (Lightning's ``SLURMEnvironment`` reads them; nothing else launches)."""
    port, tasks = free_port(), nodes * per_node
    processes = []
    for task in range(tasks):
        slurm = {
            "SLURM_NTASKS": str(tasks),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_NNODES": str(nodes),
            "SLURM_NODEID": str(task // per_node),
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task % per_node),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "d9d_two_nodes",  # not "bash": a batch job, not an interactive allocation
            "SLURM_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), json.dumps(config)],
                cwd=tmp_path,
                env={**clean_environment(), **slurm, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    wait_all(processes, "SLURM tasks")


def one_node_of_four(config: dict[str, Any], tmp_path: Path) -> None:
    """4 ranks of one node, forked by ``trainer_script.py --fork`` after its imports with torchrun's environment
    (``GROUP_RANK`` 0): new processes, other than the nodes' that saved. torchrun's 4 fresh interpreters each
    imported torch and Lightning (about 10 s of this test on 2 cores); torchrun itself is the two-node run's
    launcher above."""
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--fork", json.dumps([config])],
        cwd=tmp_path,
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_all([process], "one node of 4")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("two_nodes")
    config = {**TWO_NODES, "save_every": SAVED_AT, "ckpt_dir": str(tmp / "ckpt"), "out": str(tmp / "out.pt")}
    torchrun_nodes(config, tmp)
    return {"result": torch.load(config["out"], weights_only=False), "checkpoints": tmp / "ckpt"}


def test_two_torchrun_nodes_match_one_process(two_nodes: dict[str, Any]) -> None:
    result = two_nodes["result"]
    assert result["environment"] == "TorchElasticEnvironment" and result["node_ranks"] == [0, 0, 1, 1]
    expected = reference_run(TWO_NODES)
    assert_same_training(two_nodes["result"], expected)
    assert_same_grad_norms(two_nodes["result"], expected)


def test_the_two_node_checkpoint_resumes_on_one_node_of_four_processes(
    two_nodes: dict[str, Any], tmp_path: Path
) -> None:
    resumed_config = {
        **TWO_NODES,
        "devices": 4,
        "num_nodes": 1,
        "resume_from": str(two_nodes["checkpoints"] / f"step={SAVED_AT}.ckpt"),
        "out": str(tmp_path / "resumed.pt"),
    }
    one_node_of_four(resumed_config, tmp_path)
    resumed, full = torch.load(resumed_config["out"], weights_only=False), two_nodes["result"]
    assert resumed["node_ranks"] == [0, 0, 0, 0]
    assert_same_training(
        {"losses": resumed["losses"], "params": resumed["params"]},
        {"losses": full["losses"][SAVED_AT:], "params": full["params"]},
        tolerance=0.0,  # the same mesh on other processes: the same sums in the same order
    )
    assert resumed["grad_norms"] == full["grad_norms"][SAVED_AT:]


def test_slurm_tasks_match_one_process(tmp_path: Path) -> None:
    config = {**TWO_NODES, "out": str(tmp_path / "slurm.pt")}
    slurm_tasks(config, tmp_path)
    got = torch.load(config["out"], weights_only=False)
    assert got["environment"] == "SLURMEnvironment" and got["node_ranks"] == [0, 0, 1, 1]
    expected = reference_run(TWO_NODES)
    assert_same_training(got, expected)
    assert_same_grad_norms(got, expected)
