"""Gradient accumulation with a counted loss weighs micro-steps by their tokens: each optimizer step's gradient
is the token mean of all its batches (micro-steps, data-parallel ranks, pipeline microbatches), as one process
computing the loss of the whole step would have it, not a mean of the micro-steps' token means.

Padded labels (``PaddedCorpus``) give every micro-step, rank and microbatch its own token count; the reference
(``reference_run``) weighs each micro-step's loss by its share of the step's tokens, knowing the whole step in
advance. No clipping: a threshold that bites would rescale a wrong gradient scale away (the gradient norms are
compared before clipping, to 1e-6). ``accumulate=3`` with 4-batch epochs also ends each epoch on a window of one
micro-step (Lightning steps at the end of an epoch), which must be that batch's token mean.
"""

from __future__ import annotations

import pytest
import torch
from test_pipeline_parity import reference_for, run_forked
from test_trainer_parity import BASE, assert_same_grad_norms, assert_same_training

from lightning_d9d.modules.loss import scale_gradient

# lr 3e-4 as for the other padded cases (test_trainer_parity.py's fsdp2_padded): AdamW scales the
# summation-order noise of near-zero gradients up to ~lr.
PADDED = {"pad": True, "lr": 3e-4, "max_steps": 4}
CASES: dict[str, dict] = {
    # windows of 3, 1, 3, 1 micro-steps (4-batch epochs)
    "one_process_accumulate3": {
        **PADDED,
        "devices": 1,
        "dp": 1,
        "accumulate": 3,
        "steps_per_epoch": 4,
    },
    # Qwen3-MoE: the router losses weigh each micro-step as its loss does (its share of the step's tokens)
    "moe_one_process_accumulate2": {
        **PADDED,
        "devices": 1,
        "dp": 1,
        "accumulate": 2,
        "max_steps": 3,
        "moe": {"router_aux_loss_coef": 0.1},  # 10x the tiny default: a wrong router scale shows
    },
    "fsdp2_accumulate2": {**PADDED, "devices": 2, "dp": 2, "accumulate": 2},
    "pp2_accumulate2": {
        **PADDED,
        "devices": 2,
        "dp": 1,
        "accumulate": 2,
        "dims": {"pp": 2, "dp_shard": 1, "pipeline_schedule": "1F1B", "microbatches": 2},
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_forked(CASES, tmp_path_factory.mktemp("token_weighted_accumulation"))


@pytest.mark.parametrize("case", list(CASES))
def test_accumulation_is_the_token_mean_of_the_step(case: str, runs: dict[str, dict]) -> None:
    expected = reference_for({**BASE, **CASES[case]})
    assert_same_grad_norms(runs[case], expected)  # first: the most sensitive to a wrong weighting
    assert_same_training(runs[case], expected)  # the logged losses stay each micro-step's own token mean


def test_scale_gradient_keeps_the_value_and_scales_the_gradient() -> None:
    """What a micro-step logs is what it computed (bit for bit, an infinite loss too); only the gradient moves."""
    weight = torch.tensor([1.5, -2.0], requires_grad=True)
    for loss in ((weight * 3.1).sum() / 7, weight.exp().sum() * float("inf")):
        scaled = scale_gradient(loss, torch.tensor(0.37))
        assert torch.equal(scaled.detach(), loss.detach())
    weight.grad = None
    scale_gradient((weight**2).sum(), torch.tensor(0.25)).backward()
    assert torch.equal(weight.grad, torch.tensor([0.75, -1.0]))
