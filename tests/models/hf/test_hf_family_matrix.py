"""The family matrix: every ``transformers`` decoder family of ``tiny_hf.FAMILIES`` under every degree, trained
against the unmodified model in one process, and the table of the outcomes in ``docs/transformers.md``.

Each case is ``layout_runs.train_layout`` (the adapter's plans as the strategy applies them, ``model_loss``'s
token weighting, 3 AdamW steps on tiny_hf's batches, fp32) on 2 gloo ranks (4 for the compositions), held to
``tiny_hf.reference_run`` (the unmodified model, ``causal_lm_loss`` on its logits, the same optimizer and batches)
within ``test_hf_layout_runs.FP32_BAND``, with ``layout_runs.assert_applied`` showing the degree applied. All
2-rank cases share one launch and all 4-rank cases another: a case costs a fraction of a second, a launch seconds.

A case passes, or is refused by the adapter with the reason ``REFUSED`` states (a real impossibility, matched
against the error); anything else fails. Each family runs with the settings that make its special paths run at
this size (``MATRIX_FIELDS``: windows shorter than the 8-token rows, Granite's multipliers, a NoPE layer, padding
ids inside the tiny vocabulary), untied, and tied at tp=2 and pp=2 (where a tied head changes the plan).

The table: ``pytest tests/models/hf/test_hf_family_matrix.py`` fails when ``docs/transformers.md``'s matrix is
not the one the outcomes give; ``LIGHTNING_D9D_WRITE_FAMILY_MATRIX=1`` writes it there.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from layout_runs import Layout, Shape, assert_applied, differences, start_parameters, train_layouts
from test_hf_layout_runs import CPU, FP32_BAND
from tiny_hf import FAMILIES, reference_run, tiny_causal_lm

STEPS = 3  # AdamW steps a case: each moves every parameter by about lr, far above the band
WINDOW = 4  # half of tiny_hf's 8-token rows: every layer's window bites, also on a cp=2 shard
ALTERNATING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
MATRIX_FIELDS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": WINDOW},
    "starcoder2": {"sliding_window": WINDOW},
    "gemma2": ALTERNATING,
    "gemma3": ALTERNATING,
    "gpt_oss": ALTERNATING,
    "granite": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    },
    "smollm3": {"no_rope_layers": [1, 0], "pad_token_id": 0},  # layer 1 without RoPE
    "phi3": {"pad_token_id": 0},
    "glm4": {"pad_token_id": 0},
}

# The decoder families of transformers with a *ForCausalLM (and a tp or pp plan, except StableLM's config).
MATRIX_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "granite",
    "glm4",
    "smollm3",
    "gpt_oss",
    "deepseek_v3",
    "qwen2_moe",
    "cohere",
    "stablelm",
    "starcoder2",
)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")
# The degrees, each on 2 ranks; ep with dp_shard=2 (ep's ranks come from the data-parallel ones).
DEGREES: dict[str, dict[str, int]] = {
    "dp_shard2": {"dp_shard": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
    "cp2 heads": {"cp": 2},
    "ep2": {"dp_shard": 2, "ep": 2},
    "tp2 tied": {"tp": 2},
    "pp2 tied": {"pp": 2},
}
HYBRID = "cp4 heads (2 query heads)"
TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}
# The degrees composed, on 4 ranks, for the families that take each.
COMPOSED: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "tp2 x dp_shard2": ({"tp": 2, "dp_shard": 2}, ("llama", "qwen3", "gemma3", "qwen3_moe")),
    "pp2 x tp2": ({"pp": 2, "tp": 2}, ("llama", "qwen3", "gemma2")),
    "cp2 x tp2": ({"cp": 2, "tp": 2}, ("llama", "qwen3", "mistral")),
    "ep2 x dp_shard4": ({"dp_shard": 4, "ep": 2}, ("qwen3_moe", "mixtral")),
    "pp2 x ep2": ({"pp": 2, "dp_shard": 2, "ep": 2}, ("qwen3_moe", "mixtral")),
    # 2 query heads (1 key/value head), which cp=4 does not divide: heads over 2 ranks, keys gathered over 2
    HYBRID: ({"cp": 4}, ("llama", "qwen3", "mistral", "gemma2", "gpt_oss")),
}

# (family, degree) -> (a pattern the error must match, the reason the docs give). Only real impossibilities.
REFUSED: dict[tuple[str, str], tuple[str, str]] = {}


# Tied heads: the families whose configs tie them by default, and Qwen3 and Llama (their small checkpoints,
# Qwen3-0.6B to 4B and Llama 3.2 1B / 3B, tie them).
TIED_FAMILIES = ("gemma", "gemma2", "gemma3", "cohere", "smollm3", "starcoder2", "qwen3", "llama")


def applies(family: str, degree: str) -> bool:
    if degree.endswith("tied"):
        return family in TIED_FAMILIES
    return "ep" not in degree or family in MOE_FAMILIES


def shape_for(family: str, degree: str) -> Shape:
    fields = dict(MATRIX_FIELDS.get(family, {}))
    if degree.endswith("tied"):
        fields["tie_word_embeddings"] = True
    if degree == HYBRID:
        fields.update(TWO_HEADS)
    return Shape(layers=CPU.layers, steps=STEPS, model=fields)


def variant(degree: str) -> str:
    """The degree whose model fields a case's reference run takes: untied, tied or two-headed."""
    return "tied" if degree.endswith("tied") else HYBRID if degree == HYBRID else ""


def layout_for(family: str, dims: dict[str, int], *, heads: bool = False, hybrid: bool = False) -> Layout:
    world = 1
    for degree in dims.values():
        world *= degree
    if "ep" in dims:
        world //= dims["ep"]  # ep's ranks are the data-parallel ones
    context = ("heads" if heads or hybrid else "all_gather") if "cp" in dims else "auto"
    return Layout(family, world, dims, context_attention=context, hybrid_heads=hybrid)


def cases() -> dict[str, tuple[str, str, Layout]]:
    """Every case by its id ``family/degree``: (family, degree, layout)."""
    found = {}
    for family in (family for family in MATRIX_FAMILIES if family in FAMILIES):
        for degree, dims in DEGREES.items():
            if applies(family, degree):
                found[f"{family}/{degree}"] = (
                    family,
                    degree,
                    layout_for(family, dims, heads="heads" in degree),
                )
    for degree, (dims, families) in COMPOSED.items():
        for family in families:
            found[f"{family}/{degree}"] = (family, degree, layout_for(family, dims, hybrid=degree == HYBRID))
    return found


@functools.cache
def outcomes() -> dict[str, Any]:
    """Each case's result (``layout_runs.train_layout``'s) or the traceback of its failure, by case id."""
    by_world: dict[int, list[tuple[str, Layout, Shape]]] = {}
    for name, (family, degree, layout) in cases().items():
        by_world.setdefault(layout.world, []).append((name, layout, shape_for(family, degree)))
    results: dict[str, Any] = {}
    for world, runs in sorted(by_world.items()):
        results |= run_distributed(train_layouts, world, runs, "fp32", timeout=600)[0]
    return results


@functools.cache
def reference(family: str, kind: str) -> dict[str, Any]:
    fields = shape_for(family, kind).model
    return reference_run(tiny_causal_lm(family, layers=CPU.layers, **fields), STEPS)


@functools.cache
def start(family: str, kind: str) -> dict[str, torch.Tensor]:
    return start_parameters(Layout(family), shape_for(family, kind))


@functools.cache
def outcome(name: str) -> str:
    """``"pass"``, ``"refused: <reason>"`` for an expected refusal, or what went wrong."""
    family, degree, layout = cases()[name]
    got = outcomes()[name]
    expected_refusal = REFUSED.get((family, degree))
    if got is None:
        return "failed: no result"
    if isinstance(got, str):
        if expected_refusal is not None and re.search(expected_refusal[0], got):
            return f"refused: {expected_refusal[1]}"
        return f"failed:\n{got}"
    if expected_refusal is not None:
        return f"ran, though REFUSED names it: {expected_refusal}"
    reference_facts = [{"layers": list(range(CPU.layers)), "float8_linears": 0}]
    try:
        assert_applied(layout, got["facts"], reference_facts)
    except AssertionError as error:
        return f"not applied: {error}"
    expected = reference(family, variant(degree))
    params = dict(got["params"])
    if "lm_head.weight" in params and "lm_head.weight" not in expected["params"]:
        # a tied head on another pipeline stage than the embedding: its own copy, which must stay the same
        head, embedding = params.pop("lm_head.weight"), params["model.embed_tokens.weight"]
        if not torch.allclose(head, embedding, rtol=0, atol=1e-6):
            return f"the tied head and embedding drifted apart: {(head - embedding).abs().max():.3g}"
    errors = differences({**got, "params": params}, expected, start(family, variant(degree)))
    worse = {key: errors[key] for key, band in FP32_BAND.items() if errors[key] > band}
    if worse or errors["steps"] != STEPS or errors["moved"] <= 0.1:  # (about 0.5 when trained)
        return f"differs: {errors}"
    return "pass"


@pytest.mark.parametrize("name", list(cases()))
def test_the_family_trains_under_the_degree_as_one_process(name: str) -> None:
    result = outcome(name)
    assert result == "pass" or result.startswith("refused: "), result


DOC = Path(__file__).resolve().parents[3] / "docs" / "transformers.md"
START, END = (
    "<!-- family matrix: generated by tests/models/hf/test_hf_family_matrix.py -->",
    "<!-- end of matrix -->",
)


def table() -> str:
    """The outcomes as Markdown: one row a family, one column a degree; the compositions below."""
    found = cases()

    def cell(name: str) -> str:
        if name not in found:
            return "—"
        result = outcome(name)
        return (
            "✓"
            if result == "pass"
            else result.removeprefix("refused: ")
            if result.startswith("refused")
            else "✗"
        )

    lines = ["| family | " + " | ".join(DEGREES) + " |", "|---" * (len(DEGREES) + 1) + "|"]
    for family in MATRIX_FAMILIES:
        lines.append(f"| {family} | " + " | ".join(cell(f"{family}/{degree}") for degree in DEGREES) + " |")
    lines += ["", "| composed (4 ranks) | families | outcome |", "|---|---|---|"]
    for degree, (_, families) in COMPOSED.items():
        cells = ", ".join(f"{family} {cell(f'{family}/{degree}')}" for family in families)
        lines.append(f"| {degree} | {', '.join(families)} | {cells} |")
    return "\n".join(lines)


def test_the_docs_show_the_matrix_the_outcomes_give() -> None:
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the matrix's markers {START!r} ... {END!r}"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    generated = f"{START}\n{table()}\n{END}"
    if os.environ.get("LIGHTNING_D9D_WRITE_FAMILY_MATRIX") == "1":
        DOC.write_text(head + generated + tail)
        return
    assert f"{START}{rest.split(END, 1)[0]}{END}" == generated, (
        "docs/transformers.md's family matrix is not the one the tests give: "
        "LIGHTNING_D9D_WRITE_FAMILY_MATRIX=1 pytest tests/models/hf/test_hf_family_matrix.py writes it"
    )
