"""The throughput benchmark's correctness guard (benchmarks/train_throughput.py): a path whose loss after the
timed steps is not finite or not within 2% of the baseline's is marked and fails the run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_throughput import LOSS_TOLERANCE, _summary, check_losses, derive, parse_args


def _run(path: str, final: float) -> dict:
    return {"path": path, "ok": True, "losses": [11.9, 9.0, final]}


def test_guard_marks_paths_outside_the_band_and_non_finite_losses() -> None:
    results = [
        _run("hf_fsdp_compiled", 7.50),
        _run("ours_trainer_compiled", 7.50 * (1 + LOSS_TOLERANCE / 2)),
        _run("ours_trainer_compiled_selective", 7.50 * (1 + 2 * LOSS_TOLERANCE)),  # trained too little
        _run("ours_trainer_compiled_nofsdp", math.nan),
        {"path": "ours_trainer", "ok": False, "error": "failed"},
    ]
    check_losses(results)
    assert [r.get("loss_ok") for r in results] == [True, True, False, False, None]
    assert math.isclose(results[1]["loss_vs_baseline"], LOSS_TOLERANCE / 2)


def test_without_a_baseline_only_finiteness_is_checked() -> None:
    results = [_run("ours_trainer_compiled", 7.5), _run("ours_eager", math.inf)]
    check_losses(results)
    assert [r["loss_ok"] for r in results] == [True, False]


def test_every_path_gets_the_same_fresh_batch_each_step() -> None:
    """The guard compares paths that trained on the same data: ``_batches`` is a function of the arguments
    alone, gives each step (warm-up, measured and probe steps) its own batch, shifts labels by one token, and
    draws from a skewed distribution a model can learn (uniform ids would leave every path at ln(vocab))."""
    from train_throughput import _batches, parse_args

    args = parse_args(
        ["--seq-len", "4096", "--batch-size", "2", "--warmup", "2", "--steps", "3", "--probe-steps", "1"]
    )
    inputs, labels = _batches(args, 500, "cpu")
    again, _ = _batches(args, 500, "cpu")
    assert inputs.shape == labels.shape == (2 + 3 + 1, 2, 4096)
    assert torch.equal(inputs, again)
    assert all(not torch.equal(inputs[0], inputs[step]) for step in range(1, inputs.shape[0]))
    assert torch.equal(inputs[:, :, 1:], labels[:, :, :-1])
    counts = torch.bincount(inputs.flatten(), minlength=500).float()
    entropy = -(counts / counts.sum() * (counts / counts.sum()).clamp(min=1e-12).log()).sum()
    assert entropy < math.log(500) - 0.3  # learnable: well below the uniform distribution's ln(vocab)


def test_the_gpu_tests_training_data_is_the_benchmarks() -> None:
    """tests/gpu/zipf_training.py (the FP8 gpu tests' loop) draws the benchmark's batches: it builds the
    benchmark's arguments, so an option added there cannot break it unseen on a machine without a GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from train_throughput import _batches, parse_args
    from zipf_training import zipf_batches

    inputs, labels = zipf_batches(300, steps=3, batch_size=2, seq_len=64, device=torch.device("cpu"))
    args = parse_args(
        ["--seq-len", "64", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--probe-steps", "0"]
    )
    expected_inputs, expected_labels = _batches(args, 300, "cpu")  # 1 + 2 steps: the same three batches
    assert torch.equal(inputs, expected_inputs) and torch.equal(labels, expected_labels)


def test_the_fa4_and_cudnn_paths_force_their_backends_and_the_others_nothing() -> None:
    from train_throughput import DEFAULT_PATHS, PATHS, path_environment

    for path in ("ours_trainer_compiled_fa4", "ours_trainer_compiled_nofsdp_fa4"):
        assert path in PATHS and path not in DEFAULT_PATHS  # by name: each needs flash_attn.cute
        assert path_environment(path) == {"LIGHTNING_D9D_ATTENTION": "flash_attn4"}
    # the cuDNN side of the pair is forced too: auto takes FA4 wherever it is installed
    assert "ours_trainer_compiled_nofsdp_cudnn" in PATHS
    assert path_environment("ours_trainer_compiled_nofsdp_cudnn") == {"LIGHTNING_D9D_ATTENTION": "sdpa_cudnn"}
    assert path_environment("ours_trainer_compiled_nofsdp") == {}


def test_a_master_weight_path_keeps_its_optimizer_under_an_attention_suffix() -> None:
    """``_master_fa4`` is master weights *and* FA4: the suffix must not turn the optimizer back to fused AdamW."""
    from train_throughput import _master_weights, path_environment

    for path in ("ours_trainer_compiled_nofsdp_master_fa4", "hf_trainer_compiled_nofsdp_master_fa4"):
        assert _master_weights(path) and path_environment(path) == {"LIGHTNING_D9D_ATTENTION": "flash_attn4"}
    assert _master_weights("ours_trainer_compiled_nofsdp_master_cudnn")
    assert _master_weights("ours_trainer_compiled_nofsdp_master")
    for path in ("ours_trainer_compiled_nofsdp_fa4", "ours_trainer_compiled_nofsdp", "hf_fsdp_compiled"):
        assert not _master_weights(path)


def test_the_ratios_are_of_median_steps_not_of_the_window_s_tokens() -> None:
    """One slow step in the baseline's window moves its mean tokens/s, not its median step: the table's ``vs``
    columns are ratios of median steps (what the targets of docs/benchmarks.md name), the mean ratio stays in the
    JSON beside them."""
    args = parse_args(["--seq-len", "8", "--batch-size", "2", "--steps", "4"])
    results = [
        {
            "path": path,
            "ok": True,
            "step_ms": _summary(steps),
            "elapsed_s": sum(steps) / 1e3,
            "losses": [9.0, 7.5],
        }
        for path, steps in (
            ("hf_fsdp_compiled", [100.0, 100.0, 100.0, 500.0]),
            ("ours_trainer_compiled", [50.0] * 4),
        )
    ]
    derive(results, args, fpt=1)
    assert results[1]["median_vs_hf_fsdp_compiled"] == 2.0
    assert results[1]["vs_hf_fsdp_compiled"] == 4.0  # 800 ms against 200 ms for the window
