"""A transformers causal LM under context parallelism (our load-balanced split and attention, registered through
transformers' attention interface; positions by global index), against one process running the unmodified model
on padded data (or packed rows): losses, pre-step gradient norms and parameters after several AdamW steps, on
gloo ranks (CPU, fp32); sliding-window families with a window shorter than the rows, so that it bites. Also what
cp refuses, and ``Trainer(strategy=D9DStrategy(cp=2))`` (``hf_context_trainer_run.py``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_distributed
from test_hf_refusals import tiny
from test_hf_tensor_parallel import STEPS, VOCAB, full, tiny_model
from test_hf_tensor_parallel import train as train_unpadded
from torch import nn

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import check_hf_model, parallelize_hf
from lightning_d9d.models.hf.context import CONTEXT_ATTENTION_NAME, _attention_path
from lightning_d9d.modules.context_attention import LoadBalancedSplit
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, local_loss, maybe_loss_parallel

SEQ, ROWS, PAD = 16, 4, 0
# per row: (left, right) padding; unequal, so that the cp ranks and rows count different tokens
PADDING = [(0, 3), (5, 0), (0, 0), (0, 9)]
SCRIPT = Path(__file__).with_name("hf_context_trainer_run.py")
# a sliding window shorter than the rows (SEQ), and longer than a cp rank's chunk: it bites inside the rows and
# reaches keys of the other rank
WINDOW = 8
# the sliding-window families: Mistral and StarCoder2 on every layer (no layer_types), Gemma2 and Gemma3 one
# sliding and one full layer; Gemma2 with an attention logit soft cap of 1 (its default 50 barely bends the tiny
# model's logits: skipping the cap moves its losses by less than the tolerance)
ALTERNATING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
SOFT_CAP = 1.0
WINDOWED: dict[str, tuple[type, type, dict[str, Any]]] = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": WINDOW}),
    "starcoder2": (
        transformers.Starcoder2Config,
        transformers.Starcoder2ForCausalLM,
        {"sliding_window": WINDOW},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {**ALTERNATING, "attn_logit_softcapping": SOFT_CAP},
    ),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, ALTERNATING),
    # attention sinks on a sliding and a full layer, as GPT-OSS's own configs alternate them; 4 experts, top-2
    "gpt_oss_sliding": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        {**ALTERNATING, "num_local_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None},
    ),
}
# packed rows: documents of these lengths fill each row of SEQ, some longer than the window
DOCUMENTS = [(11, 5), (3, 13), (16,), (9, 2, 5)]


def cp_model(family: str, *, two_heads: bool = False) -> nn.Module:
    """The tiny model (the same seeded weights on every call), in training mode; ``two_heads``: 2 query heads and
    1 key/value head instead of 4 and 2 (the sliding-window families), which cp=4 does not divide."""
    if family not in WINDOWED:
        assert not two_heads, family
        return tiny_model(family, tied=False)
    config_class, model_class, window = WINDOWED[family]
    torch.manual_seed(0)
    heads = (2, 1) if two_heads else (4, 2)
    fields = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": heads[0], "num_key_value_heads": heads[1], "head_dim": 16,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "initializer_range": 0.1,
    }  # fmt: skip
    model = model_class(config_class(**fields, **window))
    model.train()
    return model


def packed_positions() -> torch.Tensor:
    """``[ROWS, SEQ]`` positions restarting at 0 per document (:data:`DOCUMENTS`)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask (1 keep, 0 pad) and already shifted labels (-100 on padding)."""
    generator = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    mask = torch.ones(ROWS, SEQ, dtype=torch.int64)
    for row, (left, right) in enumerate(PADDING):
        for cut in (slice(0, left), slice(SEQ - right, SEQ)):
            ids[row, cut], mask[row, cut], labels[row, cut] = PAD, 0, -100
    return ids, mask, labels


def train(model: nn.Module, *, inputs: str, split: LoadBalancedSplit | None = None, tp: bool = False) -> dict:
    """AdamW on fixed padded batches, fed with their padding ``attention_mask`` (``inputs="mask"``), without it
    (``"ids"``) or as packed rows (``"packed"``: :func:`packed_positions`, no cache, so that ``transformers``
    builds the documents' mask); under cp (``split``) each rank feeds its chunks of every row and weighs its
    loss by its share of the counted tokens (as the strategy does), so that FSDP's mean over the cp ranks is the
    token mean. Per step the global token-mean loss and the gradient norm before the step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)
    losses, norms = [], []
    for step in range(STEPS):
        ids, mask, labels = padded_batch(step)
        positions = packed_positions()
        if split is not None:
            ids, mask, labels, positions = (split.split(t, dim=1) for t in (ids, mask, labels, positions))
        with maybe_loss_parallel(tp):
            if inputs == "packed":
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            else:
                logits = model(input_ids=ids, attention_mask=mask if inputs == "mask" else None).logits
            loss = local_loss(causal_lm_loss(logits, labels))
            if split is not None:
                count = causal_lm_loss.count(labels).to(torch.int64)
                total = count.clone()
                dist.all_reduce(total)
                total = total // (dist.get_world_size() // split.cp)  # tp peers count the same tokens
                loss = loss * (count * split.cp / total)
            loss.backward()
        norms.append(math.sqrt(sum(float(full(p.grad).pow(2).sum()) for p in model.parameters())))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if split is not None:
            # the cp ranks' shares sum to cp x the mean; tp peers hold the same
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return {"losses": losses, "norms": norms}


def parallel_body(family: str, cp: int, tp: int, inputs: str, recompute: bool | str) -> dict[str, Any] | None:
    model = cp_model(family)
    dims = ParallelDims(cp=cp, tp=tp).resolve(dist.get_world_size()).build_mesh("cpu")
    options = ParallelOptions(context_attention="all_gather", activation_checkpointing=recompute)
    parallelize_hf(model, dims, options)
    seen: dict[str, Any] = {}

    def positions(_: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("positions", kwargs.get("position_ids", args[1] if len(args) > 1 else None).clone())

    def mask(_: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("layer_mask", kwargs.get("attention_mask"))

    model.model.rotary_emb.register_forward_pre_hook(positions, with_kwargs=True)
    model.model.layers[0].register_forward_pre_hook(mask, with_kwargs=True)
    split = LoadBalancedSplit(cp, dims.mesh_for("cp").get_local_rank())
    result = train(model, inputs=inputs, split=split, tp=dims.tp_enabled)
    params = {
        name.replace("._checkpoint_wrapped_module", ""): full(p).detach().clone()
        for name, p in model.named_parameters()
    }
    layer_mask = seen["layer_mask"]
    result.update(
        positions=seen["positions"].tolist(),
        expected_positions=split.split(packed_positions()).tolist()
        if inputs == "packed"
        else [split.positions(SEQ).tolist()],
        layer_mask=None if layer_mask is None else tuple(layer_mask.shape),
        implementation=model.config._attn_implementation,
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() != 0:
        return None
    return {"ranks": gathered, "params": params}


def compare(family: str, cp: int, tp: int, inputs: str, recompute: bool | str = False) -> dict[str, Any]:
    got = run_distributed(parallel_body, cp * tp, family, cp, tp, inputs, recompute)[0]
    reference = cp_model(family)
    expected = train(reference, inputs=inputs)
    expected_params = dict(reference.named_parameters())
    first = got["ranks"][0]
    assert set(got["params"]) == set(expected_params)
    start = cp_model(family).state_dict()
    return {
        "ranks": got["ranks"],
        "loss_error": max(abs(a - b) for a, b in zip(first["losses"], expected["losses"], strict=True)),
        "norm_error": max(abs(a - b) for a, b in zip(first["norms"], expected["norms"], strict=True)),
        "param_error": max(
            float((p - expected_params[n].detach()).abs().max()) for n, p in got["params"].items()
        ),
        "moved": max(float((p.detach() - start[n]).abs().max()) for n, p in expected_params.items()),
    }


@pytest.mark.parametrize(
    ("family", "cp", "tp", "inputs", "recompute"),
    [
        ("qwen3", 2, 1, "mask", False),
        ("qwen3", 2, 1, "ids", "selective"),  # recompute replays the all-gather attention
        ("llama", 2, 1, "mask", False),
        ("llama", 2, 2, "mask", True),  # composes with tp + sequence parallelism
        ("gpt_oss", 2, 1, "mask", False),  # attention sinks: a softmax logit per head
        # sliding windows (WINDOWED) of 8 on rows of 16, with a padding mask (the family matrix,
        # test_hf_family_matrix.py, runs every windowed family on ids alone)
        ("mistral", 2, 1, "mask", False),
        ("gemma2", 2, 1, "mask", False),  # with its attention logit soft cap
        ("mistral", 2, 1, "packed", False),  # the window within each document
        ("gpt_oss_sliding", 2, 1, "mask", False),
    ],
)
def test_cp_matches_one_process(family: str, cp: int, tp: int, inputs: str, recompute: bool | str) -> None:
    got = compare(family, cp, tp, inputs, recompute)
    for rank in got["ranks"]:
        assert rank["implementation"] == CONTEXT_ATTENTION_NAME
        assert (
            rank["positions"] == rank["expected_positions"]
        )  # RoPE at this rank's global (document) positions
        # no local causal mask built by transformers; a padding mask goes on as the whole sequence's keys, packed
        # rows as this rank's queries' rows of the documents' mask
        layer_mask = {"mask": (ROWS, 1, 1, SEQ), "ids": None, "packed": (ROWS, 1, SEQ // cp, SEQ)}
        assert rank["layer_mask"] == layer_mask[inputs]
    assert got["ranks"][0]["positions"] != got["ranks"][1]["positions"] or tp > 1
    assert got["moved"] > 1e-3  # the steps changed the parameters
    assert got["loss_error"] <= 1e-5
    assert got["norm_error"] <= 1e-5
    assert got["param_error"] <= 1e-5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"layer_types": ["linear_attention"]},
            r"^Qwen3ForCausalLM: cp=2: its config \(Qwen3Config\) has layer_types \['linear_attention'\]; "
            r"context parallelism implements full and sliding-window causal attention only",
        ),
        (
            {"attention_dropout": 0.1},
            r"^Qwen3ForCausalLM: cp=2: its config \(Qwen3Config\) has attention_dropout=0\.1; context-parallel "
            r"attention has no dropout",
        ),
    ],
)
def test_what_cp_cannot_run_exactly_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(NotImplementedError, match=message):
        check_hf_model(tiny(**overrides), ParallelDims(cp=2))


@pytest.mark.parametrize("family", ["mistral", "starcoder2", "gemma2", "gemma3"])
def test_sliding_windows_pass_and_torch_ring_is_refused_by_name(family: str) -> None:
    """A sliding window (every layer's, or the ``"sliding_attention"`` layers') passes the setup check; ``"auto"``
    keeps its path (torch's ring hands the windowed layers to the all-gather path), except for Gemma2's logit soft
    cap (the all-gather path for the whole model); ``"torch_ring"`` by name is refused, naming the model, its
    attention and the window (or the soft cap)."""
    model = cp_model(family)
    check_hf_model(model, ParallelDims(cp=2))
    attentions = [layer.self_attn for layer in model.model.layers]
    assert _attention_path(model, attentions, 2, "auto") == ("all_gather" if family == "gemma2" else "auto")
    assert _attention_path(model, attentions, 2, "all_gather") == "all_gather"
    name, owner = type(model).__name__, type(attentions[0]).__name__
    why = (
        rf"caps its logits \(attn_logit_softcapping={SOFT_CAP}\), which torch's ring kernels do not take; use "
        r"context_attention='all_gather' \(or 'auto'\)$"
        if family == "gemma2"
        else rf"attends within a sliding window of {WINDOW}, which torch's ring kernels do not take; use "
        r"context_attention='auto' \(the all-gather path for the windowed layers\) or 'all_gather'$"
    )
    with pytest.raises(NotImplementedError, match=rf"^{name}: cp=2: its attention \({owner}\) {why}"):
        _attention_path(model, attentions, 2, "torch_ring")


def test_attention_sinks_take_the_all_gather_path_and_torch_ring_is_refused_by_name() -> None:
    """torch's ring kernels have no sink: ``"auto"`` takes the all-gather path for a model with sinks, and
    ``"torch_ring"`` asked for by name is refused, naming the model and its attention."""
    model = tiny_model("gpt_oss", tied=False)
    attentions = [layer.self_attn for layer in model.model.layers]
    assert _attention_path(model, attentions, 2, "auto") == "all_gather"
    assert _attention_path(model, attentions, 2, "all_gather") == "all_gather"
    with pytest.raises(
        NotImplementedError,
        match=r"^GptOssForCausalLM: cp=2: its attention \(GptOssAttention\) has sinks \(a softmax logit per "
        r"head\), which torch's ring kernels do not take; use context_attention='all_gather' \(or 'auto'\)$",
    ):
        _attention_path(model, attentions, 2, "torch_ring")
    plain = tiny_model("llama", tied=False)
    plain_attentions = [layer.self_attn for layer in plain.model.layers]
    assert _attention_path(plain, plain_attentions, 2, "auto") == "auto"
    assert _attention_path(plain, plain_attentions, 2, "torch_ring") == "torch_ring"


@pytest.mark.parametrize("fused", [False, True])
def test_trainer_cp_matches_one_process(tmp_path: Path, fused: bool) -> None:
    """The strategy splits each batch in ``model_loss`` (labels with -100 at the end: the cp ranks count
    different tokens) and the adapter's plan supplies positions and attention; ``fused``: the head + loss fused
    from the base model's hidden states (the base model runs without the causal LM's forward)."""
    run = {
        "family": "qwen3",
        "tied": True,
        "devices": 2,
        "dims": {"cp": 2},
        "fused": fused,
        "out": str(tmp_path / "out.pt"),
    }
    subprocess.run([sys.executable, str(SCRIPT), json.dumps(run)], check=True, timeout=240)
    got = torch.load(run["out"])
    reference = tiny_model("qwen3", True)
    expected = train_unpadded(reference, slice(None), tensor_parallel=False)
    assert got["implementation"] == CONTEXT_ATTENTION_NAME and got["tied"]
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= 1e-5
    for name, param in reference.named_parameters():
        assert float((got["params"][name] - param.detach()).abs().max()) <= 1e-5, name
