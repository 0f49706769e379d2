"""A transformers model's plain causal forward skips the mask preparation (and its host sync) under the
adapter: the same numbers, no packed-sequence check; a padding mask, packed positions and a sliding window keep
the model's own masks."""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils
from tiny_hf import VOCAB, tiny_causal_lm

from lightning_d9d.models.hf.attention import (
    CAUSAL_ATTENTION_NAME,
    DOCUMENTS_ATTENTION_NAME,
    DOCUMENTS_ENV_VAR,
    SDPA,
    causal_attention_without_mask_sync,
)

IDS = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(3))


def packed_check_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = masking_utils.find_packed_sequence_indices

    def counted(position_ids: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_a_plain_causal_forward_skips_the_mask_and_gives_the_same_numbers(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, model = tiny_causal_lm(family), tiny_causal_lm(family)
    assert causal_attention_without_mask_sync(model)
    calls = packed_check_calls(monkeypatch)
    # in training the strategy passes use_cache=False (plan.train_without_cache): no cache, so the check runs
    expected = reference(input_ids=IDS, use_cache=False).logits
    assert len(calls) == 1  # the model as it is checks for packed sequences in every forward
    got = model(input_ids=IDS, use_cache=False).logits
    assert len(calls) == 1  # ours does not
    assert model.config._attn_implementation == CAUSAL_ATTENTION_NAME
    assert torch.equal(expected, got)
    got.sum().backward()  # and trains through it
    assert all(p.grad is not None for p in model.parameters())


def test_a_padding_mask_keeps_the_model_s_masks() -> None:
    reference, model = tiny_causal_lm("qwen3"), tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0  # left padding
    assert torch.equal(
        reference(input_ids=IDS, attention_mask=mask).logits, model(input_ids=IDS, attention_mask=mask).logits
    )
    assert model.config._attn_implementation == SDPA
    assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)  # and back


PACKED = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 0, 1, 2, 0, 1]])


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_packed_rows_take_our_documents_attention_without_transformers_packed_check(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed rows: our mask, built once per forward from the positions, gives transformers' own packed numbers
    (which cost a host sync in its packed-sequence check) in forward and backward, and each document alone."""
    reference, model = tiny_causal_lm(family), tiny_causal_lm(family)
    assert causal_attention_without_mask_sync(model)
    calls = packed_check_calls(monkeypatch)
    expected = reference(input_ids=IDS, position_ids=PACKED, use_cache=False).logits
    assert len(calls) == 1  # transformers' own packed path checks the positions on the host
    got = model(input_ids=IDS, position_ids=PACKED, use_cache=False).logits
    assert len(calls) == 1  # ours does not
    assert model.config._attn_implementation == DOCUMENTS_ATTENTION_NAME
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, theirs), ours in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the second document of row 0 (tokens 3..7) alone, at positions 0..4: the same outputs
    alone = reference(input_ids=IDS[:1, 3:], use_cache=False).logits
    torch.testing.assert_close(got[:1, 3:], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:1, 3:], reference(input_ids=IDS[:1], use_cache=False).logits[:, 3:])


def test_packed_rows_keep_transformers_path_where_asked_or_where_dropout_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    monkeypatch.setenv(DOCUMENTS_ENV_VAR, "0")
    model(input_ids=IDS, position_ids=PACKED)
    assert model.config._attn_implementation == SDPA
    monkeypatch.delenv(DOCUMENTS_ENV_VAR)
    dropping = tiny_causal_lm("qwen3", attention_dropout=0.1)
    causal_attention_without_mask_sync(dropping)
    dropping.train()(input_ids=IDS, position_ids=PACKED)
    assert dropping.config._attn_implementation == SDPA
    dropping.eval()(input_ids=IDS, position_ids=PACKED)  # no dropout in evaluation
    assert dropping.config._attn_implementation == DOCUMENTS_ATTENTION_NAME


def test_a_forward_with_a_cache_keeps_the_model_s_masks() -> None:
    """Chunked decoding: a second chunk of several tokens attends to the cached ones. SDPA's ``is_causal`` would
    align its mask top-left (each new token blind to the cache), so a forward with a cache must keep the model's
    mask, under either name transformers gives the cache (``past_key_values``; ``cache`` from 5.25)."""
    import inspect

    reference, model = tiny_causal_lm("qwen3"), tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    forward = inspect.signature(model.model.forward).parameters
    name = "cache" if "cache" in forward else "past_key_values"
    logits = []
    for lm in (reference, model):
        first = lm(input_ids=IDS[:, :5], use_cache=True)
        cache = getattr(first, name, None) or first.past_key_values
        logits.append(lm(input_ids=IDS[:, 5:], use_cache=True, **{name: cache}).logits)
        if lm is model:
            assert model.config._attn_implementation == SDPA
    assert torch.allclose(logits[0], logits[1], atol=1e-6)
    assert torch.allclose(logits[0][:, -1], reference(input_ids=IDS).logits[:, -1], atol=1e-5)


def test_a_sliding_window_or_another_attention_is_left_alone() -> None:
    windowed = tiny_causal_lm(
        "qwen3",
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=3,
        use_sliding_window=True,
    )
    assert not causal_attention_without_mask_sync(windowed)
    assert not causal_attention_without_mask_sync(tiny_causal_lm("mistral", sliding_window=3))
    eager = tiny_causal_lm("llama", attn_implementation="eager")
    assert not causal_attention_without_mask_sync(eager)
    assert eager.config._attn_implementation == "eager"
