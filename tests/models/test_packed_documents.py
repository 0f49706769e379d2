"""Packed rows on our models (fp32): the same loss and gradients as each document run alone, no attention across
a boundary (bitwise for Qwen3), prompts out of the loss; under cp=2 (2 forked gloo ranks) the whole model's
logits and gradients and the same isolation; the degree that refuses packed rows (pp)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed, summed_gradient_differences
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_d9d.data import Document, pack_documents
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.pipeline import PipelineRunner
from lightning_d9d.plans import parallelize_context, split_batch
from lightning_d9d.strategies import D9DStrategy

SEQ_LEN = 24
LENGTHS = [9, 5, 14, 3, 7, 11]  # tokens per document: 43 training positions over two rows of 24 (+ padding)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config.tiny())
    # router losses off: they are computed over a forward's tokens, so a batch of documents and each document
    # alone would differ by design; the routing itself is per token
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(output_router_logits=False))


def documents(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=generator) for n in LENGTHS]


def packed_batch(docs: list) -> dict[str, torch.Tensor]:
    rows = list(pack_documents(docs, SEQ_LEN, whole_documents=True))
    return torch.utils.data.default_collate(rows)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_a_packed_batch_is_each_document_alone(kind: str) -> None:
    model = build(kind)
    docs = documents(model.config.vocab_size)
    batch = packed_batch(docs)
    assert batch["input_ids"].shape == (3, SEQ_LEN)  # whole documents: 9+5 | 14+3+7... packed in order
    loss = causal_lm_loss(model(batch["input_ids"], batch["position_ids"]), batch["labels"])
    loss.backward()
    packed_grads = grads(model)
    model.zero_grad()

    # each document alone, batch of one, its own length; the batch's loss is the mean over every token
    total = sum(n - 1 for n in LENGTHS)
    alone = sum(
        causal_lm_loss(model(doc[None, :-1]), doc[None, 1:]) * (doc.numel() - 1) / total for doc in docs
    )
    alone.backward()
    torch.testing.assert_close(loss, alone, rtol=1e-5, atol=1e-5)
    alone_grads = grads(model)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    # the masked path matters: the same rows attended across documents give another loss
    crossing = causal_lm_loss(model(batch["input_ids"]), batch["labels"])
    assert abs(float(crossing.detach()) - float(loss.detach())) > 1e-3


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_changing_one_document_moves_no_other_documents_output(kind: str) -> None:
    model = build(kind).eval()
    docs = documents(model.config.vocab_size)
    batch = packed_batch(docs)
    changed_docs = list(docs)
    changed_docs[1] = torch.flip(docs[1], (0,)) % (model.config.vocab_size - 1) + 1  # document 1 (row 0)
    changed = packed_batch(changed_docs)
    with torch.no_grad():
        before = model(batch["input_ids"], batch["position_ids"])
        after = model(changed["input_ids"], changed["position_ids"])
    start, end = LENGTHS[0] - 1, LENGTHS[0] - 1 + LENGTHS[1] - 1  # document 1's positions in row 0
    assert (before[0, start:end] != after[0, start:end]).any(-1).all()  # its own outputs moved
    before[0, start:end] = after[0, start:end] = 0
    if kind == "qwen3":  # every op is per token or inside a document: bitwise
        moved = (before != after).any(-1)
        assert not moved.any(), f"outputs moved outside the changed document: {moved.nonzero().tolist()}"
    else:
        # the experts' matmuls run over the tokens routed to each expert, whose number changes with document
        # 1's routing: CPU GEMMs of another height round the same row differently in the last bit (measured:
        # at most 1.2e-7 here); attention, the only op that mixes positions, is the dense case above
        print(f"moe: max change outside the document {float((before - after).abs().max()):.1e}")
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_prompt_tokens_do_not_count_in_the_loss_or_the_gradients() -> None:
    model = build("qwen3")
    generator = torch.Generator().manual_seed(2)
    prompt, answer = (torch.randint(1, 200, (n,), generator=generator) for n in (6, 5))
    tokens = torch.cat([prompt, answer])
    batch = packed_batch(
        [Document(tokens, prompt_length=6), torch.randint(1, 200, (8,), generator=generator)]
    )
    loss = causal_lm_loss(model(batch["input_ids"], batch["position_ids"]), batch["labels"])
    loss.backward()
    sft_grads = grads(model)
    model.zero_grad()
    # by hand: the answer's 5 tokens (predicted from position 5 on) and the other document's 7 predictions
    logits = model(tokens[None, :-1])
    answer_sum = nn.functional.cross_entropy(logits[0, 5:], tokens[6:], reduction="sum")
    other = batch["input_ids"][0, 10:17], batch["labels"][0, 10:17]  # both documents fit row 0
    other_sum = nn.functional.cross_entropy(model(other[0][None])[0], other[1], reduction="sum")
    by_hand = (answer_sum + other_sum) / (5 + 7)
    by_hand.backward()
    torch.testing.assert_close(loss, by_hand, rtol=1e-5, atol=1e-6)
    for name, grad in grads(model).items():
        torch.testing.assert_close(sft_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _under_context_parallelism(kind: str) -> dict[str, float]:
    """cp=2 (this rank's load-balanced half of each row, rows of 24 cut into 4 chunks of 6, documents crossing
    the chunks' edges) against the whole model in one process: this rank's logits, the gradients summed over the
    ranks, and the outputs moved outside a changed document (bitwise for Qwen3)."""
    model = build(kind)
    whole_model = build(kind)  # the same seed: the same weights
    docs = documents(model.config.vocab_size)
    batch = packed_batch(docs)
    changed_docs = list(docs)
    changed_docs[1] = torch.flip(docs[1], (0,)) % (model.config.vocab_size - 1) + 1  # document 1 (row 0)
    changed = packed_batch(changed_docs)
    generator = torch.Generator().manual_seed(3)  # the same weights on both ranks
    weights = torch.randn(*batch["input_ids"].shape, model.config.vocab_size, generator=generator)
    whole_logits = whole_model(batch["input_ids"], batch["position_ids"])
    (whole_logits * weights).sum().backward()

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    split = parallelize_context(model, mesh)
    (ids, positions), local_weights = split_batch(split, (batch["input_ids"], batch["position_ids"]), weights)
    logits = model(ids, positions)
    (logits * local_weights).sum().backward()
    differences = {"logits": (logits - split.split(whole_logits.detach())).abs().max().item()}
    differences.update(summed_gradient_differences(model, whole_model))

    with torch.no_grad():
        (changed_ids, changed_positions), _ = split_batch(
            split, (changed["input_ids"], changed["position_ids"]), weights
        )
        after = model(changed_ids, changed_positions)
        crossing = model(ids)  # the same rows attended across documents
    start, end = LENGTHS[0] - 1, LENGTHS[0] - 1 + LENGTHS[1] - 1  # document 1's positions in row 0
    outside = torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    outside[0, start:end] = False
    outside = split.split(outside)
    differences["moved outside the changed document"] = (after - logits.detach())[outside].abs().max().item()
    inside = (after - logits.detach())[~outside]  # rank 0 holds none of it: its queries see it only as keys
    differences["moved inside it"] = inside.abs().max().item() if inside.numel() else 0.0
    differences["attended across documents"] = (crossing - logits.detach()).abs().max().item()
    return differences


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_packed_rows_under_context_parallelism_are_the_whole_model(kind: str) -> None:
    ranks = run_distributed(_under_context_parallelism, 2, kind)
    inside = max(differences.pop("moved inside it") for differences in ranks)
    assert inside > 1e-3, f"the changed document's outputs did not move ({inside:.3g})"
    for rank, differences in enumerate(ranks):
        crossing = differences.pop("attended across documents")
        outside = differences.pop("moved outside the changed document")
        assert crossing > 1e-3, f"rank {rank}: the document mask changed nothing ({crossing:.3g})"
        # as on one process: bitwise for Qwen3; the experts' GEMMs over another number of routed tokens round
        # the last bit differently for Qwen3-MoE
        assert outside <= (0.0 if kind == "qwen3" else 1e-6), f"rank {rank}: moved by {outside:.3g}"
        for name, difference in differences.items():
            assert difference <= 1e-5, f"rank {rank}: {name} differs by {difference:.3g}"


def test_a_split_without_the_cp_group_names_parallelize_context() -> None:
    model = build("qwen3")
    model.model.context_split = LoadBalancedSplit(2, 0)  # set by hand: parallelize_context sets the group too
    batch = packed_batch(documents(model.config.vocab_size))
    with pytest.raises(
        ValueError, match=r"context_group is None\): parallelize the model with parallelize_context"
    ):
        model(batch["input_ids"][:, :12], batch["position_ids"][:, :12])


def test_pipeline_inputs_other_than_ids_and_positions_are_refused_by_name() -> None:
    strategy = D9DStrategy(pp=2)
    model = nn.Linear(2, 2)
    strategy._runner = SimpleNamespace(model=model)  # type: ignore[assignment]
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"\(input_ids, position_ids\) or a dict of those names; got 3 positional"
    ):
        strategy.model_loss(model, (ids, ids, ids), ids, causal_lm_loss)
    with pytest.raises(ValueError, match=r"got \['attention_mask', 'input_ids'\]"):
        strategy.model_loss(model, {"input_ids": ids, "attention_mask": ids}, ids, causal_lm_loss)


def test_a_pipeline_stage_without_position_ids_is_refused_naming_it() -> None:
    class Stage(nn.Module):
        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return inputs

    stages = {0: build("qwen3").pipeline_stage([0], first=True, last=False), 1: Stage()}
    runner = SimpleNamespace(stages=stages, _accepted_kwargs=set())
    with pytest.raises(
        ValueError, match=r"pipeline stage 1 \(Stage\) takes no position_ids.*position_ids=None"
    ):
        PipelineRunner.check_stage_kwargs(runner, {"position_ids": torch.zeros(1)})  # type: ignore[arg-type]


def test_flexattention_moves_no_other_documents_output_either(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's block mask, run on CPU forward-only: the dense path's outputs, and the same isolation,
    bitwise. torch's unfused FlexAttention here evaluates the element mask everywhere, so this holds the mask the
    kernel evaluates; which tiles it skips or runs unmasked is held by tests/modules/test_documents.py (against
    the dense mask) and, in the kernel, by tests/gpu/test_packed_gpu.py."""
    model = build("qwen3").eval()
    generator = torch.Generator().manual_seed(4)
    lengths = (60, 200, 41, 150, 30, 90)
    docs = [torch.randint(1, 200, (n,), generator=generator) for n in lengths]
    changed_docs = list(docs)
    changed_docs[1] = torch.flip(docs[1], (0,))
    rows = [torch.utils.data.default_collate(list(pack_documents(d, 256))) for d in (docs, changed_docs)]
    monkeypatch.setenv("LIGHTNING_D9D_DOCUMENT_ATTENTION", "flex")
    with torch.no_grad():
        before, after = (model(r["input_ids"], r["position_ids"]).flatten(0, 1) for r in rows)
        monkeypatch.setenv("LIGHTNING_D9D_DOCUMENT_ATTENTION", "sdpa")
        dense = model(rows[0]["input_ids"], rows[0]["position_ids"]).flatten(0, 1)
    torch.testing.assert_close(before, dense, rtol=1e-5, atol=1e-5)
    # rows continue one another: document 1's 199 training positions follow document 0's 59, across the rows
    span = slice(lengths[0] - 1, lengths[0] - 1 + lengths[1] - 1)
    assert (before[span] != after[span]).any(-1).all()
    before[span] = after[span] = 0
    moved = (before != after).any(-1)
    assert not moved.any(), f"outputs moved outside the changed document: {moved.nonzero().tolist()}"
