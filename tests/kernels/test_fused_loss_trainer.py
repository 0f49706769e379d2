"""``Trainer(strategy="d9d")`` with the fused LM head + cross-entropy (forced on CPU, where it is off by default)
equals the single-process loop on logits: FSDP over 2 processes with padded labels (token-weighted ranks),
gradient accumulation, a head tied to the embedding, context parallelism; under tensor parallelism it steps
aside for the logits path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from test_trainer_parity import BASE, assert_matches_reference, run_trainer

CASES = {
    "fused_fsdp2_padded_accumulate": {
        "devices": 2,
        "dp": 2,
        "max_steps": 3,
        "accumulate": 2,
        "pad": True,
        "lr": 3e-4,
        "validate": True,
    },
    "fused_fsdp2_tied": {"devices": 2, "dp": 2, "max_steps": 3, "model": {"tie_word_embeddings": True}},
    # each cp rank's loss over its part of the sequences, weighed like a data-parallel rank's
    "fused_cp2": {"devices": 2, "dp": 1, "max_steps": 3, "dims": {"cp": 2}},
    # tp > 1: the fused path steps aside for logits + loss parallel (logged)
    "fused_tp2_falls_back": {"devices": 2, "dp": 1, "max_steps": 3, "dims": {"tp": 2}},
}


def test_fused_loss_matches_the_logits_loop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")  # the launched ranks inherit it
    configs = {name: {**BASE, **case} for name, case in CASES.items()}
    results = run_trainer(list(configs.values()), tmp_path, "fused_loss", names=list(configs))
    for name, config in configs.items():
        assert_matches_reference(results[name], config)
        # the fused path ran on every training batch, except where tp makes it step aside
        calls = results[name]["fused_loss_calls"]
        if name.endswith("falls_back"):
            assert calls == 0, name
        else:
            assert calls >= config["max_steps"] * config.get("accumulate", 1), (name, calls)
