"""A chat fine-tune on packed rows under tp=2 (sequence and loss parallel) learns the assistant's tokens alone.

The expected values never read the packer's labels: they come from the chat template's own mask
(``apply_chat_template(..., return_assistant_tokens_mask=True)``). Token by token, a packed label is the next
token where that token is the assistant's and ``-100`` everywhere else. On 2 gloo ranks a tiny ``transformers``
Qwen3 (the adapter's plan, as the strategy runs it) trains on the rows with SGD; one process runs the unmodified
model on each conversation alone and takes the cross-entropy by hand over the positions whose next token the
template marks as the assistant's: the losses, the first step's gradients and the parameters after the steps
agree (so the packed rows' attention also stays within each conversation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import transformers
from chat_tokenizer import MARKED, word_tokenizer
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_d9d.data import PackedDataset, chat_documents
from lightning_d9d.loss import forward_loss
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, maybe_loss_parallel

CONVERSATIONS = [
    [
        {"role": "system", "content": "answer in words"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and three plus three"},
        {"role": "assistant", "content": "six of course"},
    ],
    [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello there friend"}],
    [
        {"role": "user", "content": "count to three"},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "thanks"},  # a user's turn after the last reply: context only
    ],
    [
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "another one"},
        {"role": "assistant", "content": "green like grass"},
        {"role": "user", "content": "and the sky"},
        {"role": "assistant", "content": "blue again"},
    ],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "is water wet"},
        {"role": "assistant", "content": "yes"},
    ],
]
# 41, 15, 22, 44 and 21 tokens: rows of two conversations and padding, one row filled exactly, one conversation
# alone with padding
SEQ_LEN, VOCAB, TP, STEPS, LR = 64, 64, 2, 3, 0.5


def templated(tokenizer: Any) -> list[tuple[list[int], list[bool]]]:
    """Each conversation's token ids and the template's own mask of the assistant's tokens."""
    encoded = [
        tokenizer.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for c in CONVERSATIONS
    ]
    return [(list(e["input_ids"]), [bool(m) for m in e["assistant_masks"]]) for e in encoded]


def packed_rows() -> tuple[dict[str, torch.Tensor], list[tuple[list[int], list[bool]]]]:
    """The rows as a batch, and what the template says of each conversation."""
    tokenizer = word_tokenizer(MARKED, CONVERSATIONS)
    assert len(tokenizer) <= VOCAB
    rows = PackedDataset(chat_documents(CONVERSATIONS, tokenizer), SEQ_LEN)
    batch = torch.utils.data.default_collate([rows[i] for i in range(len(rows))])
    return batch, templated(tokenizer)


def placements(batch: dict[str, torch.Tensor], ids: Sequence[int]) -> list[tuple[int, int]]:
    """Where the conversation's inputs (its tokens but the last) lie in the rows: (row, first position)."""
    inputs = torch.tensor(ids[:-1])
    rows, width = batch["input_ids"].shape
    return [
        (row, at)
        for row in range(rows)
        for at in range(width - len(inputs) + 1)
        if torch.equal(batch["input_ids"][row, at : at + len(inputs)], inputs)
    ]


def test_packed_labels_are_the_next_token_exactly_where_the_template_marks_it_the_assistants() -> None:
    batch, conversations = packed_rows()
    labels = batch["labels"]
    assert labels.shape == (3, SEQ_LEN)
    covered = torch.zeros_like(labels, dtype=torch.bool)
    for number, (ids, mask) in enumerate(conversations):
        found = placements(batch, ids)
        assert len(found) == 1, f"conversation {number} lies {len(found)} times in the rows, not once whole"
        ((row, at),) = found
        span = slice(at, at + len(ids) - 1)
        assert batch["position_ids"][row, span].tolist() == list(range(len(ids) - 1)), number
        for position in range(len(ids) - 1):  # the label at a position predicts the token after it
            target, assistants = ids[position + 1], mask[position + 1]
            expected = target if assistants else -100
            assert int(labels[row, at + position]) == expected, (number, position, target, assistants)
        assert not covered[row, span].any(), f"conversation {number} overlaps another"
        covered[row, span] = True
    assert (labels[~covered] == -100).all()  # the padding learns nothing
    assert int((labels != -100).sum()) == sum(sum(mask[1:]) for _, mask in conversations)


def tiny_qwen3() -> nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=SEQ_LEN,
        initializer_range=0.1,  # larger than the default, so that the gradients are far from zero
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.train()
    return model


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_body(batch: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """SGD on the packed rows under tp=2, the loss as the strategy computes it (``forward_loss``, its backward
    under ``loss_parallel``)."""
    model = tiny_qwen3()
    dims = ParallelDims(tp=TP).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize_hf(model, dims, ParallelOptions())
    between_layers: list[tuple[int, ...]] = []
    model.model.layers[1].register_forward_pre_hook(
        lambda _, args: between_layers.append(tuple(args[0].shape))
    )
    logits_local: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda *hook: logits_local.append(tuple(hook[2].to_local().shape)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    losses, first_grads = [], {}
    for step in range(STEPS):
        loss = forward_loss(model, inputs, batch["labels"], causal_lm_loss, tensor_parallel=True, scale=None)
        with maybe_loss_parallel(True):
            loss.backward()
        if step == 0:
            first_grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return None
    return {
        "losses": losses,
        "first_grads": first_grads,
        "params": params,
        "between_layers": between_layers[0],
        "logits_local": logits_local[0],
    }


def by_hand(model: nn.Module, conversations: list[tuple[list[int], list[bool]]]) -> torch.Tensor:
    """The mean cross-entropy over the tokens the template marks as the assistant's, each conversation run alone
    (no packing): at position ``t`` the model predicts token ``t + 1``."""
    total, count = torch.zeros(()), 0
    for ids, mask in conversations:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        learnt = torch.tensor(mask[1:])
        targets = torch.tensor(ids[1:])
        total = total - log_probs[learnt].gather(1, targets[learnt, None]).sum()
        count += int(learnt.sum())
    return total / count


def assert_close_named(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 on both sides; the sums run over other orders of shards and ranks."""
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=lambda text: f"{name}: {text}")


def test_tp2_chat_fine_tune_learns_the_templates_assistant_tokens_alone() -> None:
    batch, conversations = packed_rows()
    got = run_distributed(tensor_parallel_body, TP, batch)[0]
    assert got["between_layers"] == (3, SEQ_LEN // TP, 32)  # sequence parallel
    assert got["logits_local"] == (3, SEQ_LEN, VOCAB // TP)  # loss parallel: vocabulary-sharded logits
    reference = tiny_qwen3()
    start = {name: p.detach().clone() for name, p in reference.named_parameters()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = by_hand(reference, conversations)
        loss.backward()
        if step == 0:
            for name, p in reference.named_parameters():
                assert p.grad is not None and p.grad.abs().max() > 1e-4, name
                assert_close_named(name, got["first_grads"][name], p.grad)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    for name, p in reference.named_parameters():
        assert (p.detach() - start[name]).abs().max() > 1e-3, f"{name}: the steps left it alone"
        assert_close_named(name, got["params"][name], p.detach())
