"""A ``transformers`` causal LM under head-parallel context parallelism (``context_attention="heads"``): each cp
rank runs the model's own attention function (SDPA, or the family's eager one) over the whole sequence for its
heads, against one process running the unmodified model: losses, pre-step gradient norms and parameters after
several AdamW steps within 1e-5 (gloo, CPU, fp32). Qwen3 with a padding mask and without, Mistral's sliding window
on packed rows, Gemma 2's attention soft cap (eager) with its sliding layers, GPT-OSS's sinks (eager) on a
sliding and a full layer: every case in one 2-rank launch. Mistral's packed rows, Gemma 2 and GPT-OSS padded with
2 query heads at cp=4, which cp does not divide (heads over 2 ranks, keys gathered over 2): one 4-rank launch.
Also what head-parallel refuses, and the masks it builds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_hf_context_parallel import SEQ, WINDOW, cp_model, packed_positions, train
from test_hf_tensor_parallel import full
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.models.hf.head_parallel import _OWN_ATTENTION, whole_sequence_mask
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.head_parallel_attention import HeadParallelAttention
from lightning_d9d.modules.hybrid_attention import HybridHeadParallelAttention
from lightning_d9d.plans import ParallelOptions

TOLERANCE = 1e-5
# name -> (family, inputs: "mask" a padding mask, "ids" none, "packed" packed rows' position_ids)
CASES: dict[str, tuple[str, str]] = {
    "qwen3_padded": ("qwen3", "mask"),
    "qwen3": ("qwen3", "ids"),
    "mistral_packed": ("mistral", "packed"),  # a window of 8 on rows of 16, within each document
    "gemma2_padded": ("gemma2", "mask"),  # soft cap 1 and a sliding layer: its eager attention
    "gpt_oss_sliding_padded": ("gpt_oss_sliding", "mask"),  # sinks on a sliding and a full layer: eager
}
OWN = {"qwen3": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss_sliding": "eager"}


# cp=4 and 2 query heads, which it does not divide: heads split over 2 ranks, keys gathered over 2, with each mask
HYBRID_CASES: dict[str, tuple[str, str]] = {
    "mistral_packed": ("mistral", "packed"),
    "gemma2_padded": ("gemma2", "mask"),
    "gpt_oss_sliding_padded": ("gpt_oss_sliding", "mask"),
}


def _runs(cp: int, cases: dict[str, tuple[str, str]]) -> dict[str, Any] | None:
    """Each case trained under cp with ``context_attention="heads"`` (2 query heads at cp=4), with what its
    attention and first layer saw."""
    dims = ParallelDims(cp=cp).resolve(dist.get_world_size()).build_mesh("cpu")
    split = LoadBalancedSplit(cp, dims.mesh_for("cp").get_local_rank())
    results: dict[str, Any] = {}
    for name, (family, inputs) in cases.items():
        model = cp_model(family, two_heads=cp == 4)
        parallelize_hf(model, dims, ParallelOptions(context_attention="heads"))
        attention = model.model.layers[0].self_attn
        seen: dict[str, Any] = {}

        def positions(_: nn.Module, args: tuple, kwargs: dict, seen: dict[str, Any] = seen) -> None:
            seen.setdefault(
                "positions", kwargs.get("position_ids", args[1] if len(args) > 1 else None).clone()
            )

        def mask(_: nn.Module, args: tuple, kwargs: dict, seen: dict[str, Any] = seen) -> None:
            seen.setdefault("layer_mask", kwargs.get("attention_mask"))

        model.model.rotary_emb.register_forward_pre_hook(positions, with_kwargs=True)
        model.model.layers[0].register_forward_pre_hook(mask, with_kwargs=True)
        result = train(model, inputs=inputs, split=split)
        layer_mask = seen["layer_mask"]
        own = getattr(attention, _OWN_ATTENTION, None)
        result.update(
            attend=type(attention._d9d_context_attention).__name__,
            own=None if own is None else own[0],
            positions=seen["positions"].tolist(),
            expected_positions=split.split(packed_positions()).tolist()
            if inputs == "packed"
            else [split.positions(SEQ).tolist()],
            layer_mask=None if layer_mask is None else tuple(layer_mask.shape),
            params={n: full(p).detach().clone() for n, p in model.named_parameters()},
        )
        results[name] = result
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_runs, 2, 2, CASES)


@pytest.fixture(scope="module")
def hybrid_runs() -> list[dict[str, Any]]:
    return run_distributed(_runs, 4, 4, HYBRID_CASES)


def _trains_like_one_process(family: str, inputs: str, got: dict[str, Any], *, two_heads: bool) -> None:
    reference = cp_model(family, two_heads=two_heads)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected = train(reference, inputs=inputs)
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= TOLERANCE
    assert max(abs(a - b) for a, b in zip(got["norms"], expected["norms"], strict=True)) <= TOLERANCE
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in reference.named_parameters())
    assert moved > 1e-3  # the steps changed the parameters
    assert set(got["params"]) == set(start)
    for n, p in reference.named_parameters():
        assert float((got["params"][n] - p.detach()).abs().max()) <= TOLERANCE, n


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_heads_trains_like_one_process(case: str, runs: list[dict[str, Any]]) -> None:
    family, inputs = CASES[case]
    for rank in runs:
        got = rank[case]
        assert got["attend"] == HeadParallelAttention.__name__ and got["own"] == OWN[family]
        assert (
            got["positions"] == got["expected_positions"]
        )  # RoPE at this rank's global (document) positions
        # the padding's keys of the whole sequence, the whole packed rows' documents, or nothing (causal)
        assert got["layer_mask"] == {"mask": (4, 1, 1, SEQ), "ids": None, "packed": (4, 1, SEQ, SEQ)}[inputs]
    _trains_like_one_process(family, inputs, runs[0][case], two_heads=False)


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_cp4_heads_cp_does_not_divide_trains_like_one_process(
    case: str, hybrid_runs: list[dict[str, Any]]
) -> None:
    family, inputs = HYBRID_CASES[case]
    for rank in hybrid_runs:
        got = rank[case]
        assert got["attend"] == HybridHeadParallelAttention.__name__ and got["own"] is None
        assert got["positions"] == got["expected_positions"]
        # the padding's keys of the whole sequence, or this rank's queries' rows of the packed documents' mask
        assert got["layer_mask"] == {"mask": (4, 1, 1, SEQ), "packed": (4, 1, SEQ // 4, SEQ)}[inputs]
    _trains_like_one_process(family, inputs, hybrid_runs[0][case], two_heads=True)


def test_the_whole_sequence_mask_is_what_one_process_gives_each_implementation() -> None:
    """SDPA: ``None`` for the plain causal mask (its ``is_causal``), booleans otherwise; eager: the additive mask
    (0 or the dtype's lowest); the window's band; a padded query sees itself."""
    assert whole_sequence_mask(None, 4, torch.device("cpu")) is None
    causal = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    windowed = whole_sequence_mask(None, 4, torch.device("cpu"), window=2)
    assert windowed is not None and windowed.dtype == torch.bool
    assert torch.equal(windowed[0, 0], causal & ~torch.tril(torch.ones(4, 4, dtype=torch.bool), diagonal=-2))
    eager = whole_sequence_mask(None, 4, torch.device("cpu"), additive=torch.float32)
    assert eager is not None and torch.equal(eager[0, 0] == 0, causal)
    assert float(eager.min()) == torch.finfo(torch.float32).min
    padding = torch.tensor([0, 1, 1, 1], dtype=torch.bool)[None, None, None, :]  # the first token is padding
    padded = whole_sequence_mask(padding, 4, torch.device("cpu"))
    assert padded is not None and padded[0, 0, 0].tolist() == [True, False, False, False]  # itself only
    assert padded[0, 0, 3].tolist() == [False, True, True, True]


def test_an_implementation_it_builds_no_mask_for_is_refused_by_name() -> None:
    from lightning_d9d.models.hf.head_parallel import keep_own_attention

    model = cp_model("qwen3")
    attentions = [layer.self_attn for layer in model.model.layers]
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(
        NotImplementedError,
        match=r"^Qwen3ForCausalLM: context_attention='heads' runs the model's own attention with a mask built for "
        r"the whole sequence, for 'sdpa' and 'eager' so far; its config asks for 'flex_attention': load the "
        r"model with attn_implementation='sdpa' \(or 'eager'\), or use context_attention='all_gather'$",
    ):
        keep_own_attention(model, attentions)
    model.config._attn_implementation = "sdpa"
    keep_own_attention(model, attentions)
    assert getattr(attentions[0], _OWN_ATTENTION)[0] == "sdpa"
    assert WINDOW < SEQ  # the windowed cases' window bites
