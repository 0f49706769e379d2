"""Packed rows (several documents per row, ``position_ids`` restarting at 0 per document) on a ``transformers``
causal LM under the adapter, one process (CPU, fp32): ``model_loss``'s forward gives each document's own loss and
gradients (1e-5), through the logits path and the fused head + loss; changing one document moves no output of
another; validation (eval mode) attends per document too; a tuple that would hand the positions to the forward's
``attention_mask`` is refused. The degrees are in ``tests/fabric/test_fabric_parity.py`` (``hf_*_packed``)."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from tiny_hf import VOCAB, tiny_causal_lm
from torch import nn

from lightning_d9d import model_loss
from lightning_d9d.data import PackedDataset
from lightning_d9d.loss import forward_loss
from lightning_d9d.models.hf.attention import causal_attention_without_mask_sync
from lightning_d9d.models.hf.context import _GlobalPositions
from lightning_d9d.models.hf.pipeline import TransformersPipeline
from lightning_d9d.models.hf.plan import train_without_cache
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss

SEQ = 12
# documents of these many tokens fill 2 rows of 12 positions exactly: [5, 4, 3] and [6, 6] training positions
LENGTHS = (6, 5, 4, 7, 7)


def packed_rows() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    documents = [torch.randint(0, VOCAB, (n,), generator=generator) for n in LENGTHS]
    rows = PackedDataset(documents, SEQ)
    batch = [rows[i] for i in range(2)]
    return {key: torch.stack([row[key] for row in batch]) for key in batch[0]}


def adapted(family: str) -> nn.Module:
    """The tiny model with what the adapter installs on one process around its forward (the others are
    layouts: FSDP, tp, ... proven by the Fabric parity cases)."""
    model = tiny_causal_lm(family)
    assert causal_attention_without_mask_sync(model)
    train_without_cache(model)
    return model


def segments(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document piece (positions restart at 0)."""
    found = []
    for row, line in enumerate(positions.tolist()):
        starts = [t for t, p in enumerate(line) if p == 0] + [len(line)]
        found += [(row, a, b) for a, b in itertools.pairwise(starts)]
    return found


def per_document_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token mean over the batch of every document run alone (the unmodified model, no positions given)."""
    total, count = torch.zeros(()), 0
    for row, start, end in segments(batch["position_ids"]):
        labels = batch["labels"][row, start:end]
        logits = model(input_ids=batch["input_ids"][row : row + 1, start:end], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total / count


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize(("family", "fused"), [("qwen3", False), ("qwen3", True), ("qwen3_moe", True)])
def test_a_packed_batch_gives_each_document_s_loss_and_gradients(family: str, fused: bool) -> None:
    batch = packed_rows()
    assert len(segments(batch["position_ids"])) >= 5  # several documents per row
    model, reference = adapted(family), tiny_causal_lm(family)
    model.fuse_head_loss = fused
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    head_calls: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))
    # what both strategies' model_loss run without a pipeline, on one process
    loss = forward_loss(model, inputs, batch["labels"], causal_lm_loss, tensor_parallel=False, scale=None)
    hook.remove()
    assert len(head_calls) == (0 if fused else 1)  # the fused path reads the head's weight, never runs it
    loss.backward()
    expected = per_document_loss(reference, batch)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    got, want = grads(model), grads(reference)
    assert got.keys() == want.keys() == {name for name, _ in reference.named_parameters()}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    # without the positions the documents attend each other: another loss
    with torch.no_grad():
        plain = forward_loss(
            model,
            {"input_ids": batch["input_ids"]},
            batch["labels"],
            causal_lm_loss,
            tensor_parallel=False,
            scale=None,
        )
    assert abs(float(plain) - float(expected.detach())) > 1e-3


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_changing_one_document_moves_no_other_document(family: str) -> None:
    batch = packed_rows()
    model = adapted(family)
    positions = batch["position_ids"]
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"], position_ids=positions).logits
        for row, start, end in segments(positions):  # each document changed in turn
            changed = batch["input_ids"].clone()
            changed[row, start:end] = (changed[row, start:end] + 1) % VOCAB
            after = model(input_ids=changed, position_ids=positions).logits
            inside = torch.zeros(before.shape[:2], dtype=torch.bool)
            inside[row, start:end] = True
            assert not torch.equal(before[inside], after[inside])
            if family == "qwen3":
                assert torch.equal(before[~inside], after[~inside])  # bitwise
            else:  # the experts' matmuls run over the tokens routed to each, whose number changes
                # (measured at most 9.5e-7 on x86 CPU)
                assert float((before[~inside] - after[~inside]).abs().max()) <= 5e-6


def test_validation_attends_per_document_too() -> None:
    # out of training the config's use_cache=True would build a cache, and transformers then skips its
    # packed-sequence check: the adapter turns the cache off when positions come without one
    batch = packed_rows()
    model, reference = adapted("qwen3").eval(), tiny_causal_lm("qwen3").eval()
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        loss = forward_loss(model, inputs, batch["labels"], causal_lm_loss, tensor_parallel=False, scale=None)
        torch.testing.assert_close(loss, per_document_loss(reference, batch), rtol=1e-5, atol=1e-5)


def test_positions_as_a_second_positional_input_are_refused() -> None:
    batch = packed_rows()
    model = adapted("qwen3")
    module = L.LightningModule()  # outside a Trainer model_loss runs the model itself: refused all the same
    for run in (
        lambda: model_loss(
            module, model, (batch["input_ids"], batch["position_ids"]), batch["labels"], causal_lm_loss
        ),
        lambda: forward_loss(
            model,
            (batch["input_ids"], batch["position_ids"]),
            batch["labels"],
            causal_lm_loss,
            tensor_parallel=False,
            scale=None,
        ),
    ):
        with pytest.raises(
            ValueError, match=r"2 positional inputs for Qwen3ForCausalLM.*'position_ids': positions"
        ):
            run()


def test_packed_rows_under_cp_with_ring_kernels_or_a_mask_are_refused_before_any_collective() -> None:
    model = tiny_causal_lm("qwen3")
    split = LoadBalancedSplit(2, 0)
    ids, positions = torch.zeros(2, 6, dtype=torch.long), torch.tensor([[0, 1, 0, 1, 2, 3]]).expand(2, -1)
    ring = _GlobalPositions(model.base_model, split, None, masks=False)  # type: ignore[arg-type]
    with pytest.raises(
        NotImplementedError, match=r"cp=2: position_ids .*ring kernels.*context_attention='all_gather'"
    ):
        ring(model.base_model, (), {"input_ids": ids, "position_ids": positions})
    gather = _GlobalPositions(model.base_model, split, None, masks=True)  # type: ignore[arg-type]
    with pytest.raises(
        NotImplementedError, match=r"cp=2: position_ids together with an attention_mask; pass one"
    ):
        gather(model.base_model, (), {"input_ids": ids, "position_ids": positions, "attention_mask": ids + 1})


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_two_pipeline_stages_in_sequence_attend_per_document(family: str) -> None:
    # what the pipeline runner does once it hands every stage position_ids= (microbatched), on one process
    batch = packed_rows()
    model = tiny_causal_lm(family, layers=2)
    pipeline = TransformersPipeline(model)
    first = pipeline.pipeline_stage([0], first=True, last=False)
    last = pipeline.pipeline_stage([1], first=False, last=True)
    ids, positions = batch["input_ids"], batch["position_ids"]
    staged = last(first(ids, position_ids=positions), position_ids=positions)
    loss = causal_lm_loss(staged, batch["labels"])
    loss.backward()
    staged_grads = grads(model)
    expected = per_document_loss(model, batch)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, grad in grads(model).items():
        torch.testing.assert_close(staged_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # without positions: the plain causal forward, as before
        torch.testing.assert_close(last(first(ids)), model(input_ids=ids, use_cache=False).logits)
