"""``Trainer(strategy=D9DStrategy(tp=2))`` on a LightningModule holding a transformers Qwen3: losses and parameters
after several optimizer steps against one process running the unmodified model (see ``hf_trainer_run.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from test_hf_tensor_parallel import tiny_model, train

SCRIPT = Path(__file__).with_name("hf_trainer_run.py")


def test_trainer_tp_matches_one_process(tmp_path: Path) -> None:
    run = {"family": "qwen3", "tied": True, "devices": 2, "dims": {"tp": 2}, "out": str(tmp_path / "out.pt")}
    subprocess.run([sys.executable, str(SCRIPT), json.dumps(run)], check=True, timeout=240)
    got = torch.load(run["out"])
    reference = tiny_model("qwen3", True)
    expected = train(reference, slice(None), tensor_parallel=False)
    assert got["logits_sharded"] and got["tied"] and got["q_proj_split"]
    start = tiny_model("qwen3", True).state_dict()
    assert all(torch.equal(p, start[n]) for n, p in got["start"].items())  # the same model to begin with
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= 1e-5
    for name, param in reference.named_parameters():
        assert float((got["params"][name] - param.detach()).abs().max()) <= 1e-5, name
