import math

import torch

from lightning_d9d.modules import causal_lm_loss


def test_mean_over_non_ignored_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    log_probs = logits.double().log_softmax(-1)
    picked = [-log_probs[b, t, labels[b, t]] for b in range(2) for t in range(5) if labels[b, t] != -100]
    expected = torch.stack(picked).mean()
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6)


def test_bf16_logits_are_upcast() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(1, 4, 50) * 10).to(torch.bfloat16)
    labels = torch.randint(0, 50, (1, 4))
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float().view(-1, 50), labels.view(-1))
    assert torch.equal(loss, expected) or math.isclose(loss.item(), expected.item(), rel_tol=1e-6)


def test_custom_ignore_index_and_all_ignored() -> None:
    logits = torch.randn(1, 3, 7, requires_grad=True)
    labels = torch.tensor([[0, 5, 5]])
    loss = causal_lm_loss(logits, labels, ignore_index=5)
    expected = -logits.detach()[0, 0].log_softmax(-1)[0]
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6)
    empty = causal_lm_loss(logits, torch.full((1, 3), -100))
    empty.backward()
    assert empty.item() == 0.0
    assert logits.grad is not None and not logits.grad.any()
