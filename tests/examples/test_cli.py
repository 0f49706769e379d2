"""The LightningCLI example runs from its YAML files: the CPU one trains for real (2 processes, a few steps, the
TensorBoard logger switched on from the command line), and the GPU ones parse into the same classes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_qwen3_cli.py"
CONFIGS = ROOT / "examples" / "configs"


def test_the_cpu_yaml_trains_and_logs_to_tensorboard(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(CONFIGS / "cpu_tiny.yaml")]
    command += ["--trainer.max_steps", "6", "--model.max_steps", "6", "--trainer.val_check_interval", "3"]
    command += ["--trainer.log_every_n_steps", "1"]
    command += ["--trainer.logger.class_path", "lightning.pytorch.loggers.TensorBoardLogger"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    run = tmp_path / "runs" / "cli_cpu_tiny"
    assert (run / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    (events,) = (run / "logs" / "version_0").glob("events.out.tfevents.*")
    assert b"train/loss" in events.read_bytes() and b"val/ppl" in events.read_bytes()
    # what the file set reached the objects: the degrees, the model preset, the memory plan of that mesh
    saved = yaml.safe_load((run / "logs" / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["init_args"]["dp_shard"] == 2
    assert "memory plan per rank (ParallelDims(pp=1, dp_replicate=1, dp_shard=2" in output
    assert "num_experts" in (run / "logs" / "version_0" / "hparams.yaml").read_text()  # tiny-moe's config


@pytest.mark.parametrize("name", ["one_gpu.yaml", "eight_gpus.yaml"])
def test_the_gpu_yamls_parse(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from pretrain_qwen3_cli import main
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(CONFIGS / name), "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_d9d.D9DStrategy"
    assert printed["model"]["preset"] == "0.6b"
    assert printed["trainer"]["accelerator"] == "gpu"
