"""A transformers Qwen3 trained under ``Trainer(strategy=D9DStrategy(tp=2))`` on 2 processes, checkpointed every 2
steps, resumes from the mid-epoch checkpoint of step 6 with tp=1 on 1 process and continues like the
uninterrupted run: losses, pre-clip gradient norms and final parameters within 1e-5 (fp32). The checkpoint holds
the transformers parameter names. The resumed run computes its loss with the LM head fused into the
cross-entropy ($LIGHTNING_D9D_FUSED_LOSS=1), the uninterrupted one from the vocabulary-sharded logits (loss
parallel): ``model_loss(..., causal_lm_loss)`` on a transformers model takes either path.
See ``hf_resume_run.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from test_hf_tensor_parallel import tiny_model
from torch.distributed.checkpoint import FileSystemReader

SCRIPT = Path(__file__).with_name("hf_resume_run.py")
RESUME_STEP, STEPS = 6, 8


def test_mid_epoch_resume_tp2_to_tp1(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    full_run = {
        "devices": 2,
        "dims": {"tp": 2},
        "ckpt_dir": str(checkpoints),
        "out": str(tmp_path / "tp2.pt"),
    }
    resumed_run = {
        "devices": 1,
        "dims": {"tp": 1},
        "resume_from": str(checkpoints / f"step={RESUME_STEP}.ckpt"),
        "fused": True,
        "out": str(tmp_path / "tp1.pt"),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(SCRIPT), json.dumps([full_run, resumed_run])]
    subprocess.run(command, check=True, timeout=300, env=env)
    full, resumed = torch.load(full_run["out"]), torch.load(resumed_run["out"])
    assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - RESUME_STEP
    assert full["fused"] == 0 and resumed["fused"] == STEPS - RESUME_STEP  # tp: the logits path; tp=1: fused
    # the transformers names in the checkpoint (under the LightningModule's attribute "model")
    names = set(tiny_model("qwen3", False).state_dict())
    metadata = FileSystemReader(resumed_run["resume_from"]).read_metadata().state_dict_metadata
    saved = {key.removeprefix("state_dict.model.") for key in metadata if key.startswith("state_dict.")}
    assert saved == names
    for a, b in zip(resumed["losses"], full["losses"][RESUME_STEP:], strict=True):
        assert abs(a - b) <= 1e-5
    for a, b in zip(resumed["norms"], full["norms"][RESUME_STEP:], strict=True):
        assert abs(a - b) <= 1e-5 * b
    assert set(resumed["params"]) == names
    start = tiny_model("qwen3", False).state_dict()
    for name, param in full["params"].items():
        assert float((param - start[name]).abs().max()) > 1e-4, name  # the steps moved it
        assert float((resumed["params"][name] - param).abs().max()) <= 1e-5, name
