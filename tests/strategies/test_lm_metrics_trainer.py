"""The example's validation perplexity and ``Throughput`` in real Trainer runs (dp=2 and pp=2 in one 2-process
launch, dp=2 x tp=2 in a 4-process one), against one process: the perplexity of the run's own final weights
computed in the test process over the same padded validation data, and the tokens counted once per
data-parallel rank; a summed metric (validation tokens) counts every token once, where syncing over tp or pp
peers (which hold the same tokens) would count them twice."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_metrics_script import GLOBAL_BATCH, SEQ_LEN, val_corpus

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM

SCRIPT = Path(__file__).with_name("lm_metrics_script.py")
WORLD = {"dp2": 2, "pp2": 2, "dp2tp2": 4}
RUNS = {
    # validation only: dp is the world here, so throughput's count is checked where it is not (pp2)
    "dp2": {"dims": {"dp_shard": 2}, "dp": 2, "model": {}, "fit": False},
    "pp2": {
        "dims": {"pp": 2, "dp_shard": 1, "pipeline_schedule": "1F1B", "microbatches": 2},
        "dp": 1,
        "model": {"tie_word_embeddings": False},
        "fit": True,
    },
    # tp peers hold the same tokens: the metric (and throughput's tokens learnt) must sum over the 2
    # data-parallel ranks, not the 4
    "dp2tp2": {"dims": {"dp_shard": 2, "tp": 2}, "dp": 2, "model": {}, "fit": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("lm_metrics")
    configs = {
        name: {**config, "devices": WORLD[name], "out": str(folder / f"{name}.pt")}
        for name, config in RUNS.items()
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # one launch: the imports once, the ranks of each world size forked from it
    launch = sorted(configs.values(), key=lambda config: config["devices"])
    command = [sys.executable, str(SCRIPT), "--fork", json.dumps(launch)]
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {name: torch.load(config["out"], weights_only=False) for name, config in configs.items()}


# Measured: 7e-9 to 5e-8 relative between the runs and the one-process value; the wrong reductions below were
# 2.7e-4 (mean of means) to 2e-2 (rank 0 alone) off, and must be at least 20 * RTOL off.
RTOL = 1e-6


def one_process_perplexities(model_config: Qwen3Config, params: dict[str, torch.Tensor]) -> dict[str, float]:
    """In one process, over the validation set: ``exact``, exp(sum of token losses / tokens); and what wrong
    reductions would give: ``mean_of_means`` (per-batch losses averaged) and ``rank0_only`` (no sync: the samples
    of data-parallel rank 0 of 2, every second one)."""
    model = Qwen3ForCausalLM(model_config)
    model.load_state_dict({name.removeprefix("model."): p for name, p in params.items()})
    corpus = val_corpus(model_config.vocab_size)
    with torch.no_grad():
        batch = {
            key: torch.stack([corpus[i][key] for i in range(len(corpus))]) for key in ("input_ids", "labels")
        }
        logits = model(batch["input_ids"]).double()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    counted = (batch["labels"] != -100).double()
    per_sample_sum, per_sample_count = (losses * counted).sum(1), counted.sum(1)
    batches = per_sample_sum.view(-1, GLOBAL_BATCH).sum(1) / per_sample_count.view(-1, GLOBAL_BATCH).sum(1)
    return {
        "exact": math.exp(per_sample_sum.sum() / per_sample_count.sum()),
        "mean_of_means": math.exp(batches.mean()),
        "rank0_only": math.exp(per_sample_sum[0::2].sum() / per_sample_count[0::2].sum()),
    }


@pytest.mark.parametrize("name", list(RUNS))
def test_validation_perplexity_equals_one_process(runs: dict[str, dict], name: str) -> None:
    result = runs[name]
    values = one_process_perplexities(Qwen3Config.tiny(**RUNS[name]["model"]), result["params"])
    expected = values.pop("exact")
    for wrong, value in values.items():  # the padding tells the right reduction from these
        assert abs(value - expected) > 20 * RTOL * expected, wrong
    assert result["val"]["val/ppl"] == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_summed_metric_counts_every_token_once(runs: dict[str, dict], name: str) -> None:
    """Synced over the data-parallel ranks only: over the world, tp (dp2tp2) or pp (pp2) peers would double it."""
    corpus = val_corpus(Qwen3Config.tiny(**RUNS[name]["model"]).vocab_size)
    tokens = sum(int((corpus[i]["labels"] != -100).sum()) for i in range(len(corpus)))
    assert runs[name]["val"]["val/tokens"] == tokens


def test_throughput_counts_the_tokens_of_every_data_parallel_rank(runs: dict[str, dict]) -> None:
    """pp=2, dp=1: both ranks see the same batch, so the global batch is counted once (not world-size times)."""
    steps = runs["pp2"]["throughput"]
    assert len(steps) == 2 and not steps[0]  # the first step only opens the first window
    with torch.device("meta"):
        per_token = Qwen3ForCausalLM(Qwen3Config.tiny(**RUNS["pp2"]["model"])).num_flops_per_token(SEQ_LEN)
    values = steps[1]
    # tokens per second times seconds per step: the global batch's tokens
    assert values["perf/tokens_per_sec"] * values["perf/step_time"] == pytest.approx(GLOBAL_BATCH * SEQ_LEN)
    assert values["perf/tokens_per_sec_per_device"] == pytest.approx(values["perf/tokens_per_sec"] / 2)
    assert values["perf/tflops"] == pytest.approx(per_token * values["perf/tokens_per_sec"] / 1e12)
    assert "perf/mfu" not in values  # CPU: no peak


@pytest.mark.parametrize("name", ["pp2", "dp2tp2"])
def test_throughput_sums_the_tokens_learnt_over_data_parallel_ranks(runs: dict[str, dict], name: str) -> None:
    """Every training label is learnt here, so the tokens learnt are the global batch's: each data-parallel rank's
    count summed once (rank 0's alone would be half of it under dp=2, a sum over the tp peers too twice it)."""
    values = runs[name]["throughput"][1]
    learnt = values["perf/learnt_tokens_per_sec"] * values["perf/step_time"]
    assert learnt == pytest.approx(GLOBAL_BATCH * SEQ_LEN)
