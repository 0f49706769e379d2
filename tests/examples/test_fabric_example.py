"""``examples/fabric_pretrain_qwen3.py``, launched as a user would (Fabric's own launcher, 2 CPU processes): FSDP
for 20 steps, then converted to Hugging Face files. (Resuming a Fabric checkpoint on other layouts is
``tests/fabric/test_fabric_parity.py``'s; its launches are cheaper than this script's own launcher.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import transformers

from lightning_d9d.models import Qwen3Config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fabric_pretrain_qwen3.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(tmp_path: Path, *args: str) -> str:
    command = [sys.executable, str(EXAMPLE), "--output", str(tmp_path / "run"), *args]
    proc = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+) +loss ([\d.]+)", stdout, re.MULTILINE)}


def test_the_fabric_example_trains_saves_and_converts(tmp_path: Path) -> None:
    losses = _losses(_run(tmp_path, "--max-steps", "20"))
    checkpoint = tmp_path / "run" / "ckpt"
    assert (checkpoint / "manifest.json").is_file()  # the atomic format's last file
    assert sorted(losses) == [10, 20]
    # it learns the corpus's bigrams: from about ln(256) = 5.5 at the start, down by step 20
    assert losses[10] > losses[20] and losses[20] < 4.5

    # the Fabric checkpoint records the model's HF config: converted without --config, loaded by transformers
    export = tmp_path / "hf"
    command = [sys.executable, "-m", "lightning_d9d.convert", "dcp-to-hf", str(checkpoint), str(export)]
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_hidden_layers == Qwen3Config.tiny().num_hidden_layers
