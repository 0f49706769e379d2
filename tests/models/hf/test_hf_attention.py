"""A transformers model's plain causal forward skips the mask preparation (and its host sync) under the
adapter: the same numbers, no packed-sequence check; a padding mask, packed positions and a sliding window keep
the model's own masks. That forward runs our attention backends (on CPU ``auto``'s plain SDPA: transformers'
numbers bit for bit, training included), and every call they do not compute exactly runs transformers' SDPA
function."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers.masking_utils as masking_utils
from tiny_hf import VOCAB, reference_run, tiny_causal_lm
from torch import nn
from transformers.modeling_utils import AttentionInterface

import lightning_d9d.models.hf.attention as hf_attention
from lightning_d9d.models.hf.attention import (
    CAUSAL_ATTENTION_NAME,
    DOCUMENTS_ATTENTION_NAME,
    DOCUMENTS_ENV_VAR,
    SDPA,
    causal_attention_without_mask_sync,
)
from lightning_d9d.modules.attention import (
    ENV_VAR,
    AttentionBackend,
    attention_backends,
    register_attention_backend,
    select_attention_backend,
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


# transformers' attention interface, shared by every model (its registrations are global)
REGISTERED = AttentionInterface._global_mapping


@pytest.fixture
def transformers_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """transformers' SDPA function, recording the attention module of each call, in the interface before a test
    installs the switch (which captures it); the interface as it was afterwards."""
    original = REGISTERED[SDPA]
    calls: list[nn.Module] = []

    def recorded(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(module)
        return original(module, *args, **kwargs)

    monkeypatch.setitem(REGISTERED, SDPA, recorded)
    monkeypatch.setitem(REGISTERED, CAUSAL_ATTENTION_NAME, REGISTERED.get(CAUSAL_ATTENTION_NAME))
    return calls


@pytest.fixture
def our_backends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the backends our causal attention selects, one per call."""
    chosen: list[str] = []

    def recorded(q: torch.Tensor, name: str | None = None) -> AttentionBackend:
        backend = select_attention_backend(q, name)
        chosen.append(backend.name)
        return backend

    monkeypatch.setattr(hf_attention, "select_attention_backend", recorded)
    return chosen


def called_by(model: nn.Module, calls: list[nn.Module]) -> int:
    ours = {id(module) for module in model.modules()}
    return sum(id(module) in ours for module in calls)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_our_causal_attention_trains_as_transformers_sdpa(
    family: str, transformers_sdpa: list[nn.Module], our_backends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four AdamW steps and a validation pass: our backends (``auto``: plain SDPA on CPU) give the untouched
    ``sdpa`` model's losses and parameters bit for bit, and transformers' function is never called."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference, model = tiny_causal_lm(family), tiny_causal_lm(family)
    assert causal_attention_without_mask_sync(model)
    expected = reference_run(reference, 4)
    assert called_by(reference, transformers_sdpa) == 2 * 6  # 2 layers, 4 training and 2 validation forwards
    got = reference_run(model, 4)
    assert called_by(model, transformers_sdpa) == 0
    assert our_backends == ["sdpa"] * (2 * 6)
    assert got["losses"] == expected["losses"]
    assert got["val_loss"] == expected["val_loss"]
    for name, theirs in expected["params"].items():
        assert torch.equal(got["params"][name], theirs), name


def causal_function(model: nn.Module) -> Any:
    assert causal_attention_without_mask_sync(model)
    return REGISTERED[CAUSAL_ATTENTION_NAME]


def attention_inputs(length: int = 8, kv_length: int | None = None) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, length, 16, generator=generator)
    k, v = (torch.randn(2, 2, kv_length or length, 16, generator=generator) for _ in range(2))
    return q, k, v


def test_a_plain_call_runs_our_backend_in_transformers_layout(
    transformers_sdpa: list[nn.Module], our_backends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    model = tiny_causal_lm("qwen3")
    forward, module = causal_function(model), model.model.layers[0].self_attn
    q, k, v = attention_inputs()
    expected, _ = REGISTERED[SDPA](module, q, k, v, None, dropout=0.0, scaling=module.scaling)
    transformers_sdpa.clear()
    out, weights = forward(module, q, k, v, None, dropout=0.0, scaling=module.scaling, sliding_window=None)
    assert (transformers_sdpa, our_backends, weights) == ([], ["sdpa"], None)
    assert out.shape == (2, 8, 4, 16) and out.is_contiguous()  # [B, T, heads, head_dim]
    assert torch.equal(out, expected)


MASK = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
# one call per case our backends do not compute exactly: (its keywords, the length of its keys and values)
FALLBACKS: dict[str, tuple[dict[str, Any], int]] = {
    "scaling": ({"scaling": 0.3}, 8),
    "dropout": ({"dropout": 0.5}, 8),
    "attention_mask": ({"attention_mask": MASK}, 8),
    "is_causal": ({"is_causal": False}, 8),
    "softcap": ({"softcap": 30.0}, 8),
    "s_aux": ({"s_aux": torch.zeros(4)}, 8),
    "sinks": ({"sinks": torch.zeros(4)}, 8),
    "sliding_window": ({"sliding_window": 4}, 8),
    "position_bias": ({"position_bias": torch.randn(1, 4, 8, 8)}, 8),
    "cu_seq_lens": ({"cu_seq_lens_q": torch.tensor([0, 8]), "cu_seq_lens_k": torch.tensor([0, 8])}, 8),
    "longer_keys": ({}, 12),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_each_call_our_backends_do_not_compute_runs_transformers_sdpa(
    case: str, transformers_sdpa: list[nn.Module], our_backends: list[str]
) -> None:
    """The same call transformers would make, its numbers (or its refusal) included."""
    model = tiny_causal_lm("qwen3")
    forward, module = causal_function(model), model.model.layers[0].self_attn
    keywords, kv_length = FALLBACKS[case]
    keywords = {"dropout": 0.0, "scaling": module.scaling, **keywords}
    mask = keywords.pop("attention_mask", None)
    q, k, v = attention_inputs(kv_length=kv_length)
    if case == "softcap":  # transformers' SDPA refuses it
        with pytest.raises(ValueError, match="softcap"):
            forward(module, q, k, v, mask, **keywords)
        assert (transformers_sdpa, our_backends) == ([module], [])
        return
    torch.manual_seed(0)
    out, _ = forward(module, q, k, v, mask, **keywords)
    assert (transformers_sdpa, our_backends) == ([module], [])
    torch.manual_seed(0)
    expected, _ = REGISTERED[SDPA](module, q, k, v, mask, **keywords)
    assert torch.equal(out, expected)


def test_a_module_that_is_not_causal_or_a_single_query_runs_transformers_sdpa(
    transformers_sdpa: list[nn.Module], our_backends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_causal_lm("qwen3")
    forward, module = causal_function(model), model.model.layers[0].self_attn
    forward(module, *attention_inputs(length=1), None, scaling=module.scaling)
    monkeypatch.setattr(module, "is_causal", False)
    forward(module, *attention_inputs(), None, scaling=module.scaling)
    assert (transformers_sdpa, our_backends) == ([module, module], [])


def test_attention_dropout_in_training_runs_transformers_sdpa(
    transformers_sdpa: list[nn.Module], our_backends: list[str]
) -> None:
    """The same dropout as the untouched model's (the same call, the same random state); in evaluation, none,
    and our backends."""
    reference = tiny_causal_lm("qwen3", attention_dropout=0.5)
    model = tiny_causal_lm("qwen3", attention_dropout=0.5)
    causal_attention_without_mask_sync(model)
    torch.manual_seed(1)
    expected = reference(input_ids=IDS, use_cache=False).logits
    torch.manual_seed(1)
    got = model(input_ids=IDS, use_cache=False).logits
    assert called_by(model, transformers_sdpa) == 2 and our_backends == []
    assert torch.equal(got, expected)
    model.eval()(input_ids=IDS, use_cache=False)
    assert called_by(model, transformers_sdpa) == 2 and len(our_backends) == 2


def test_a_scale_of_the_model_s_own_runs_transformers_sdpa(
    transformers_sdpa: list[nn.Module], our_backends: list[str]
) -> None:
    reference, model = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    causal_attention_without_mask_sync(model)
    for lm in (reference, model):
        for layer in lm.model.layers:
            layer.self_attn.scaling = 0.1  # not 1 / sqrt(head_dim): 0.25
    expected = reference(input_ids=IDS, use_cache=False).logits
    got = model(input_ids=IDS, use_cache=False).logits
    assert called_by(model, transformers_sdpa) == 2 and our_backends == []
    assert torch.equal(got, expected)


@pytest.fixture
def sdpa_math_calls() -> Iterator[list[torch.Size]]:
    """The registered ``sdpa_math`` backend, recording its queries' shapes; put back in its place afterwards."""
    names = attention_backends()
    original = select_attention_backend(torch.zeros(1, 1, 2, 1), "sdpa_math")
    after = names.index("sdpa_math") + 1
    before = names[after] if after < len(names) else None
    calls: list[torch.Size] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape)
        return original.run(q, k, v)

    spy = AttentionBackend("sdpa_math", run, original.unsupported, original.preferred)
    register_attention_backend(spy, before=before)
    try:
        yield calls
    finally:
        register_attention_backend(original, before=before)
    assert attention_backends() == names


def test_the_attention_environment_variable_chooses_the_backend(
    sdpa_math_calls: list[torch.Size], transformers_sdpa: list[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, model = tiny_causal_lm("qwen3"), tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    monkeypatch.delenv(ENV_VAR, raising=False)
    expected = reference(input_ids=IDS, use_cache=False).logits
    model(input_ids=IDS, use_cache=False)
    assert sdpa_math_calls == []  # auto on CPU: plain SDPA
    monkeypatch.setenv(ENV_VAR, "sdpa_math")
    got = model(input_ids=IDS, use_cache=False).logits
    assert (
        sdpa_math_calls == [torch.Size((3, 4, 8, 16))] * 2
    )  # each layer, its [B, heads, T, head_dim] queries
    assert called_by(model, transformers_sdpa) == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # math's rounding, not the fused kernel's


def test_compiled_decoder_layers_trace_our_attention_whole(
    transformers_sdpa: list[nn.Module], our_backends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the compile plan compiles a dense layer (``fullgraph=True``): the backend's selection traces without a
    graph break, and the compiled layers give the eager numbers."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference, model = tiny_causal_lm("qwen3"), tiny_causal_lm("qwen3")
    causal_attention_without_mask_sync(model)
    torch.compiler.reset()
    try:
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="eager")
        got = model(input_ids=IDS, use_cache=False).logits
        got.sum().backward()
    finally:
        torch.compiler.reset()
    assert called_by(model, transformers_sdpa) == 0
    assert our_backends and set(our_backends) == {"sdpa"}
    torch.testing.assert_close(got, reference(input_ids=IDS, use_cache=False).logits, rtol=1e-6, atol=1e-6)


def test_the_fallback_is_transformers_sdpa_as_registered_at_install(
    transformers_sdpa: list[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later registration under ``"sdpa"`` (another library's, or a test's) does not change what our function
    falls back to."""
    model = tiny_causal_lm("qwen3")
    forward, module = causal_function(model), model.model.layers[0].self_attn

    def replaced(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the fallback was looked up at call time")

    monkeypatch.setitem(REGISTERED, SDPA, replaced)
    forward(module, *attention_inputs(), None, scaling=0.3)
    assert transformers_sdpa == [module]
