"""``LoadHFWeights`` and ``ExportHF`` in real ``Trainer(strategy="d9d")`` runs, ``dcp-to-hf`` on what such a run
saved, and training checkpoints resumed on another mesh (dp_shard 4 → 2, FSDP → HSDP).

All Trainer runs happen in one subprocess (``trainer_runs.py``) that imports once and forks the ranks of each run,
launched once for the module: about 20 s for the four runs on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # noqa: F401 (a test dependency: a broken install must fail, not skip)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from hf_helpers import batch, config_json, hf_logits, load_transformers, make_hf_checkpoint
from reference import reference_run
from state_helpers import read_checkpoint

from lightning_d9d.convert import main as convert_main
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM

SCRIPT = Path(__file__).with_name("trainer_runs.py")
TOLERANCE = 1e-5
HF_RUN = {"seed": 3, "max_steps": 2, "lr": 3e-3, "seq_len": 16, "global_batch": 8, "save_every": 2}
# The parity tests' setup (tests/strategies): 2 steps per epoch, so the checkpoint of step 2 closes an epoch.
TRAIN = {"seed": 7, "seq_len": 16, "global_batch": 8, "lr": 3e-3, "steps_per_epoch": 2, "schedule_steps": 8}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer_runs")
    # A tied model: its training checkpoint holds the head under both names, and the export must not.
    make_hf_checkpoint(root / "hf", tie_word_embeddings=True, vocab_size=97)
    (root / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    make_hf_checkpoint(root / "hf_tp2_dp2", tie_word_embeddings=True, vocab_size=96)  # tp must divide vocab
    (root / "hf_tp2_dp2" / "tokenizer.json").write_text('{"version": "1.0"}')
    mesh_a = root / "ckpt_fsdp4" / "step=2.ckpt"
    plan = [
        {
            **HF_RUN,
            "kind": "hf",
            "name": "hf",
            "devices": 2,
            "hf_dir": str(root / "hf"),
            "export_dir": str(root / "export"),
            "ckpt_dir": str(root / "ckpt_hf"),
            "export_every": 1,
        },
        # resuming: LoadHFWeights must leave the checkpoint's weights alone
        {**HF_RUN, "kind": "hf", "name": "hf_resumed", "devices": 2, "hf_dir": str(root / "hf"), "max_steps": 3,
         "export_dir": str(root / "export_resumed"), "save_every": 0,
         "resume_from": str(root / "ckpt_hf" / "step=2.ckpt")},
        # the same on a tp=2 x dp_shard=2 mesh: weights loaded into and exported from tensor-parallel shards
        {**HF_RUN, "kind": "hf", "name": "hf_tp2_dp2", "devices": 4, "dp": 2, "dims": {"tp": 2, "dp_shard": 2},
         "hf_dir": str(root / "hf_tp2_dp2"), "export_dir": str(root / "export_tp2_dp2"),
         "ckpt_dir": str(root / "ckpt_hf_tp2_dp2"), "export_every": 1},
        # tp=2 x cp=2: a training checkpoint and an export from tensor- and context-parallel ranks
        {**TRAIN, "kind": "train", "name": "tp2_cp2", "devices": 4, "dp": 1, "max_steps": 2, "save_every": 2,
         "dims": {"tp": 2, "cp": 2}, "ckpt_dir": str(root / "ckpt_tp2_cp2"), "export_dir": str(root / "tp2_cp2")},
        # mesh A: FSDP over 4, 2 steps, checkpoint
        {**TRAIN, "kind": "train", "name": "fsdp4", "devices": 4, "dp": 4, "max_steps": 2, "save_every": 2,
         "ckpt_dir": str(mesh_a.parent)},
        # mesh B: resume for 2 more steps on FSDP over 2, and on HSDP 2 x 2
        {**TRAIN, "kind": "train", "name": "fsdp2", "devices": 2, "dp": 2, "max_steps": 4,
         "resume_from": str(mesh_a)},
        {**TRAIN, "kind": "train", "name": "hsdp", "devices": 4, "dp": 4, "max_steps": 4,
         "dims": {"dp_replicate": 2, "dp_shard": 2}, "resume_from": str(mesh_a), "export_dir": str(root / "hsdp")},
    ]  # fmt: skip
    for run in plan:
        run["out"] = str(root / f"{run['name']}.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(plan)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"trainer runs failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    results = {run["name"]: torch.load(run["out"], weights_only=False) for run in plan}
    return {"root": root, "results": results}


def _strip(params: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {key.removeprefix(prefix): value for key, value in params.items()}


@pytest.mark.parametrize("run", ["hf", "hf_tp2_dp2"])
def test_load_hf_weights_then_train_then_export(runs: dict[str, Any], run: str) -> None:
    root, result = runs["root"], runs["results"][run]
    exported = root / ("export" if run == "hf" else f"export_{run.removeprefix('hf_')}")
    original = read_checkpoint(root / run)
    # Loaded after the strategy sharded and initialised the model (else init would have overwritten it), and
    # before the first forward pass (the sanity check's).
    assert set(result["start"]) == set(original)  # the tied head once, as the file has it
    for key, value in original.items():
        assert torch.equal(result["start"][key], value), key
    assert result["losses"][1] < result["losses"][0]

    # Every step, and not again at the end of training (step 2); transformers loads it: the trained weights, the
    # same logits.
    assert result["exports"] == [str(exported / "step=1"), str(exported / "step=2")]
    export = exported / "step=2"
    written = read_checkpoint(export)
    assert set(written) == set(result["final"]) and "lm_head.weight" not in written
    for key, value in result["final"].items():
        assert torch.equal(written[key], value), key
    assert config_json(export)["tie_word_embeddings"] is True
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(config_json(root / run)))
    ours.load_state_dict(result["final"], strict=False)  # lm_head is the embedding
    ids = batch(ours.config.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
    torch.testing.assert_close(
        hf_logits(load_transformers(export), ids), expected, rtol=TOLERANCE, atol=TOLERANCE
    )


@pytest.mark.parametrize("run", ["hf", "hf_tp2_dp2"])
def test_dcp_to_hf_on_a_multi_process_checkpoint(
    runs: dict[str, Any], run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root, result = runs["root"], runs["results"][run]
    checkpoint = root / f"ckpt_{run}" / "step=2.ckpt"  # written at the last step: the final weights
    out = root / f"converted_{run}"
    # No --config: LoadHFWeights recorded it in the checkpoint. --config with the HF directory brings the tokenizer.
    assert convert_main(["dcp-to-hf", str(checkpoint), str(out), "--stats"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["tensors"] == len(result["final"])
    written = read_checkpoint(out)
    assert set(written) == set(result["final"])
    for key, value in result["final"].items():
        assert torch.equal(written[key], value), key
    assert convert_main(["dcp-to-hf", str(checkpoint), str(out), "--config", str(root / run)]) == 0
    assert (out / "tokenizer.json").is_file()
    assert config_json(out)["hidden_size"] == config_json(root / run)["hidden_size"]
    load_transformers(out)


@pytest.fixture(scope="module")
def four_steps() -> dict[str, Any]:
    """4 uninterrupted steps on one process, without Lightning."""
    return reference_run({**TRAIN, "max_steps": 4})


@pytest.mark.parametrize("mesh_b", ["fsdp2", "hsdp"])
def test_checkpoint_of_one_mesh_resumes_on_another(
    runs: dict[str, Any], four_steps: dict[str, Any], mesh_b: str
) -> None:
    results, expected = runs["results"], four_steps
    first, resumed = results["fsdp4"], results[mesh_b]
    losses = first["losses"] + resumed["losses"]
    assert len(losses) == 4
    for step, (actual, wanted) in enumerate(zip(losses, expected["losses"], strict=True)):
        assert abs(actual - wanted) <= TOLERANCE, f"step {step}: {actual} vs {wanted}"
    assert resumed["params"].keys() == expected["params"].keys()
    worst = max(
        ((resumed["params"][n] - expected["params"][n]).abs().max().item(), n) for n in expected["params"]
    )
    assert worst[0] <= TOLERANCE, f"largest parameter difference {worst[0]:.3g} in {worst[1]}"


def test_load_hf_weights_does_not_overwrite_a_resumed_run(runs: dict[str, Any]) -> None:
    original, resumed = read_checkpoint(runs["root"] / "hf"), runs["results"]["hf_resumed"]
    first = runs["results"]["hf"]
    # Before the first forward the weights are the checkpoint's: those the first run ended with.
    for key, value in first["final"].items():
        assert torch.equal(resumed["start"][key], value), key
    assert not torch.equal(resumed["start"]["model.norm.weight"], original["model.norm.weight"])
    assert len(resumed["losses"]) == 1
    assert resumed["exports"] == [str(runs["root"] / "export_resumed" / "step=3")]


def test_export_from_an_hsdp_mesh(runs: dict[str, Any]) -> None:
    params = _strip(runs["results"]["hsdp"]["params"])
    written = read_checkpoint(runs["root"] / "hsdp" / "final")
    assert set(written) == set(params)  # Qwen3Config.tiny is untied: the head is written
    for key, value in params.items():
        assert torch.equal(written[key], value), key


def test_export_and_dcp_to_hf_from_a_tp2_cp2_mesh(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Tensor- and context-parallel ranks export the whole weights once (transformers loads them and computes
    our logits), and their training checkpoint converts to the same files."""
    root, params = runs["root"], _strip(runs["results"]["tp2_cp2"]["params"])
    exported = read_checkpoint(root / "tp2_cp2" / "final")
    assert set(exported) == set(params)
    for key, value in params.items():
        assert torch.equal(exported[key], value), key
    ours = Qwen3ForCausalLM(Qwen3Config.tiny())
    ours.load_state_dict(params)
    ids = batch(ours.config.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
    torch.testing.assert_close(
        hf_logits(load_transformers(root / "tp2_cp2" / "final"), ids),
        expected,
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )
    out = root / "converted_tp2_cp2"
    assert convert_main(["dcp-to-hf", str(root / "ckpt_tp2_cp2" / "step=2.ckpt"), str(out)]) == 0
    converted = read_checkpoint(out)
    assert set(converted) == set(params)
    for key, value in params.items():
        assert torch.equal(converted[key], value), key
