"""``CausalLMPerplexity`` and ``TokenAccuracy``: against torchmetrics' logits-fed perplexity and a hand count in
one process, and synced over 2 gloo ranks (each with its own, differently padded, batches) equal to one
process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from torchmetrics.text import Perplexity

from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.metrics import CausalLMPerplexity, TokenAccuracy

VOCAB = 11


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four batches of logits and labels, padded (-100) by very different amounts, so that a mean of batch
    means is not the token mean. The logits favour the label on some tokens, so accuracy is not ~1/VOCAB."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for index, padding in enumerate((0, 9, 2, 13)):
        labels = torch.randint(0, VOCAB, (2, 8), generator=generator)
        logits = torch.randn(2, 8, VOCAB, generator=generator) * (1 + index)
        hits = torch.rand(2, 8, generator=generator) < 0.5
        logits[hits, labels[hits]] += 4.0
        labels.view(-1)[labels.numel() - padding :] = -100
        batches.append((logits, labels))
    return batches


def _update(
    perplexity: CausalLMPerplexity, accuracy: TokenAccuracy, logits: torch.Tensor, labels: torch.Tensor
) -> None:
    tokens = causal_lm_loss.count(labels)
    perplexity.update(causal_lm_loss(logits, labels) * tokens, tokens)
    accuracy.update(logits, labels)


def test_perplexity_and_accuracy_in_one_process() -> None:
    perplexity, accuracy, reference = CausalLMPerplexity(), TokenAccuracy(), Perplexity(ignore_index=-100)
    losses, correct, total, batch_means = [], 0, 0, []
    for logits, labels in _batches():
        _update(perplexity, accuracy, logits, labels)
        reference.update(logits, labels)
        token_losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
        kept = labels != -100
        losses.append(token_losses[kept])
        batch_means.append(float(token_losses[kept].mean()))
        correct += sum(
            int(logits[b, t].argmax()) == int(labels[b, t])
            for b, t in zip(*torch.nonzero(kept, as_tuple=True), strict=True)
        )
        total += int(kept.sum())
    expected = math.exp(float(torch.cat(losses).double().mean()))
    assert float(perplexity.compute()) == pytest.approx(expected, rel=1e-6)
    assert float(perplexity.compute()) == pytest.approx(float(reference.compute()), rel=1e-5)
    assert abs(math.exp(sum(batch_means) / len(batch_means)) - expected) > 1e-2 * expected  # padding matters
    assert float(accuracy.compute()) == pytest.approx(correct / total, abs=1e-7)
    assert 0.1 < correct / total < 0.9  # neither all nor none: the comparison means something

    ids = TokenAccuracy()  # predicted ids instead of logits
    for logits, labels in _batches():
        ids.update(logits.argmax(-1), labels)
    assert float(ids.compute()) == float(accuracy.compute())
    # per-token losses (0 at ignored labels) summed by the metric
    from_token_losses = CausalLMPerplexity()
    for logits, labels in _batches():
        token_losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
        from_token_losses.update(token_losses, int((labels != -100).sum()))
    assert float(from_token_losses.compute()) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="labels' shape"):
        TokenAccuracy().update(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long))


def _on_two_ranks() -> dict[str, float]:
    """Rank r updates with batches r and r + 2; ``own_group``: metrics told to sync over this rank alone (as the
    d9d strategy points them at the data-parallel ranks) keep the rank's own value."""
    rank = dist.get_rank()
    own_group = [dist.new_group([r]) for r in range(2)][rank]
    synced = CausalLMPerplexity(), TokenAccuracy()
    alone = CausalLMPerplexity(process_group=own_group), TokenAccuracy(process_group=own_group)
    for logits, labels in _batches()[rank::2]:
        _update(*synced, logits, labels)
        _update(*alone, logits, labels)
    return {
        "perplexity": float(synced[0].compute()),
        "accuracy": float(synced[1].compute()),
        "perplexity_alone": float(alone[0].compute()),
        "accuracy_alone": float(alone[1].compute()),
    }


def test_synced_over_two_ranks_equals_one_process() -> None:
    one = CausalLMPerplexity(), TokenAccuracy()
    for logits, labels in _batches():
        _update(*one, logits, labels)
    expected = {"perplexity": float(one[0].compute()), "accuracy": float(one[1].compute())}
    ranks = run_distributed(_on_two_ranks, 2)
    for rank, values in enumerate(ranks):
        assert values["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6), rank
        assert values["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-7), rank
        local = CausalLMPerplexity(), TokenAccuracy()
        for logits, labels in _batches()[rank::2]:
            _update(*local, logits, labels)
        assert values["perplexity_alone"] == pytest.approx(float(local[0].compute()), rel=1e-6)
        assert values["accuracy_alone"] == pytest.approx(float(local[1].compute()), abs=1e-7)
        assert abs(values["perplexity_alone"] - expected["perplexity"]) > 1e-3 * expected["perplexity"]
