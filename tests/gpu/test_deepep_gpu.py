"""DeepEP on two GPUs (the two-GPU issue): its dispatcher equals the all-to-all dispatcher in bf16, and both
dispatch + combine times at the MoE benchmark's shape are printed. Needs 2 GPUs and ``deep_ep`` (built from its
v1.2.1 tag, intranode, NVSHMEM disabled); it runs ``tests/gpu/deepep_script.py`` under torchrun."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 kind)"),
    pytest.mark.skipif(
        importlib.util.find_spec("deep_ep") is None, reason="needs deep_ep built on this machine"
    ),
]

# Both paths compute the same products in bf16; they differ in where the k weighted rows of a token are summed
# (DeepEP's combine kernel vs our unpermute, both accumulating in fp32 and rounding once to bf16): one bf16
# rounding (2^-8 relative) per output element, far below this bound; a wrong token, expert or weight is O(1).
BOUND = 2e-2


def test_deepep_equals_all_to_all_on_two_gpus() -> None:
    script = Path(__file__).with_name("deepep_script.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    for rank, part in enumerate(report["ranks"]):
        worst = max(part["errors"].values())
        assert worst < BOUND, (rank, part["errors"])
