"""A transformers model's plain causal forward skips the mask preparation (and its host sync) under the
adapter: the same numbers, no packed-sequence check; a padding mask, packed positions and a sliding window keep
the model's own masks."""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils
from tiny_hf import VOCAB, tiny_causal_lm

from lightning_d9d.models.hf.attention import CAUSAL_ATTENTION_NAME, SDPA, causal_attention_without_mask_sync

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


def test_a_padding_mask_or_packed_positions_keep_the_model_s_masks() -> None:
    reference, model = tiny_causal_lm("qwen3"), tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0  # left padding
    assert torch.equal(
        reference(input_ids=IDS, attention_mask=mask).logits, model(input_ids=IDS, attention_mask=mask).logits
    )
    assert model.config._attn_implementation == SDPA
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]).expand(3, -1)  # two documents per row
    assert torch.equal(
        reference(input_ids=IDS, position_ids=packed).logits, model(input_ids=IDS, position_ids=packed).logits
    )
    assert not torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS, position_ids=packed).logits)
    assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)  # and back


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
