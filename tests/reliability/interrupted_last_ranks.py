"""Run by ``test_interrupted_last.py`` under torchrun (2 ranks): ``crash_then_resume`` on each rank, whose
result goes to ``<root>/rank<N>.json``. ``python -m torch.distributed.run --nproc-per-node=2 this.py <root>``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: distributed.py

from test_interrupted_last import crash_then_resume

if __name__ == "__main__":
    root = sys.argv[1]
    Path(root, f"rank{os.environ['RANK']}.json").write_text(json.dumps(crash_then_resume(root)))
