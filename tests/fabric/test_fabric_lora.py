"""``D9DFabricStrategy(lora=...)``'s checkpoints: adapters only, with the frozen base's fingerprint, as the Trainer's.

A Fabric loop loads its base from a Hugging Face folder itself (``load_hf``: Fabric has no ``LoadHFWeights``),
trains the adapters on 2 FSDP ranks (gloo) and saves after step 3; the checkpoint holds the adapters alone. A
resume onto the same base (loaded before ``fabric.load``) ends with the uninterrupted run's parameters and AdamW
state, bit for bit (the same layout, the same operations); onto another base it is refused, naming a frozen
parameter. All runs share one launch (``fabric_lora_loop.py --fork``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.state.frozen import FINGERPRINT_KEY, LORA_KEY
from lightning_d9d.state.hf import save_hf
from lightning_d9d.state.training import MODEL_SECTION, read_dcp_metadata, read_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_trainer_parity import first_errors

SCRIPT = Path(__file__).with_name("fabric_lora_loop.py")
SAVE_AT, STEPS = 3, 5
FSDP = {"devices": 2, "dims": {"dp_shard": 2}}
# wide enough that the files' own overhead (about 1 KB per tensor) does not hide the sizes: 1.5M parameters
SHAPE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def base_folder(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    save_hf(Qwen3ForCausalLM(Qwen3Config.tiny(**SHAPE)), path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("fabric_lora")
    base, other = base_folder(tmp / "base", seed=1), base_folder(tmp / "other", seed=2)
    ckpt = str(tmp / "lora.ckpt")
    common = {**FSDP, "shape": SHAPE, "steps": STEPS, "base": str(base)}
    configs = [
        {**common, "out": str(tmp / "full.pt"), "save_at": SAVE_AT, "ckpt": ckpt},
        {**common, "out": str(tmp / "resumed.pt"), "resume_from": ckpt},
        {
            **common,
            "out": str(tmp / "refused.pt"),
            "resume_from": ckpt,
            "base": str(other),
            "expect_refusal": True,
        },
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(SCRIPT), "--fork", json.dumps(configs)]
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(
            f"forked Fabric LoRA runs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n"
            f"first error lines of every rank:\n{first_errors(proc.stderr)}"
        )
    results = {
        name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in ("full", "resumed", "refused")
    }
    return {**results, "ckpt": Path(ckpt), "base": base}


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_a_fabric_lora_checkpoint_holds_the_adapters_and_the_base_s_fingerprint(runs: dict) -> None:
    ckpt, params = runs["ckpt"], runs["full"]["params"]
    metadata = read_dcp_metadata(ckpt).state_dict_metadata
    model_keys = {
        key.removeprefix(f"{MODEL_SECTION}.") for key in metadata if key.startswith(f"{MODEL_SECTION}.")
    }
    assert model_keys == {name for name in params if _adapter(name)}
    frozen = {name for name in params if not _adapter(name)}
    meta = read_meta(ckpt, weights_only=True)
    assert set(meta[FINGERPRINT_KEY]) == frozen
    # the settings `convert dcp-to-hf --base` merges with
    assert (meta[LORA_KEY]["rank"], meta[LORA_KEY]["alpha"], set(meta[LORA_KEY]["frozen_dtypes"])) == (
        4,
        8.0,
        frozen,
    )
    # the adapters and their AdamW moments: far fewer bytes than the base alone
    stored = sum(f.stat().st_size for f in ckpt.iterdir() if f.suffix == ".distcp")
    base_bytes = sum(params[name].numel() * 4 for name in frozen)
    assert stored < base_bytes / 3, (stored, base_bytes)


def test_a_fabric_lora_checkpoint_resumes_exactly(runs: dict) -> None:
    full, resumed = runs["full"], runs["resumed"]
    assert full["params"].keys() == resumed["params"].keys()
    for name, value in full["params"].items():
        assert resumed["params"][name].equal(value), name
    assert full["optimizer"].keys() == resumed["optimizer"].keys() and full["optimizer"]
    assert all(_adapter(name) for name in full["optimizer"])  # AdamW holds state for the adapters alone
    for name, value in full["optimizer"].items():
        assert resumed["optimizer"][name].equal(value), name
    # the adapters trained; the base is the folder's, untouched
    assert all(value.abs().max() > 0 for name, value in full["params"].items() if ".lora_B." in name)


def test_a_fabric_lora_checkpoint_refuses_another_base_by_name(runs: dict) -> None:
    refusal = runs["refused"]["refusal"]
    assert re.search(
        r"holds the trained parameters only, and the model's frozen \S+\.weight is not", refusal
    ), refusal
    assert "is not the one it was trained on" in refusal and "fabric.load" in refusal, refusal
