"""A transformers causal LM under tensor + sequence + loss parallelism from its own config's tp plan, against
one process running the unmodified model: losses, pre-step gradient norms and parameters after several AdamW
steps, on gloo ranks (CPU, fp32)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import ParallelOptions, local_loss, maybe_loss_parallel

VOCAB, HIDDEN, SEQ, ROWS, STEPS = 128, 64, 8, 4, 6
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    # a soft cap its config leaves None: the fused loss's plain head (test_hf_fused_loss.py)
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    # attention sinks (test_hf_context_parallel.py)
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    # the embedding's forward scales the lookup by sqrt(hidden) (embed_scale, cast to the weight's dtype)
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    # the same, and soft-capped attention and logits, sliding and full layers
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
}
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # a window shorter than the sequence, a cap small enough to bite
    "gemma2": {"sliding_window": 3, "final_logit_softcapping": 2.0},
    "gemma3": {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
    # full attention only, 4 experts
    "gpt_oss": {
        "layer_types": ["full_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}


def tiny_model(family: str, tied: bool, pad: int | None = None) -> nn.Module:
    """``pad``: the config's ``pad_token_id``, the embedding's ``padding_idx`` (a row ``transformers`` starts at
    zero and the lookup gives no gradient)."""
    config_class, model_class = FAMILIES[family]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        initializer_range=0.1,  # larger than the default, so that the heads' gradients are far from zero
        pad_token_id=pad,
        **FAMILY_FIELDS.get(family, {}),
    )
    torch.manual_seed(0)
    model = model_class(config)
    model.train()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels[:, -2:] = -100  # as many ignored per row: the mean over data ranks is the token mean
    return ids, labels


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train(model: nn.Module, rows: slice, *, tensor_parallel: bool) -> dict[str, Any]:
    """AdamW on fixed batches; per step the loss (averaged over the world: tp peers hold the same) and the
    gradient norm before the step."""
    # eps well above the gradients' rounding noise (~1e-8 here: sums over other orders of ranks and shards):
    # Adam steps an entry by about lr * g / (|g| + eps), which with the default eps=1e-8 turns a difference in the
    # last bits of a near-zero g into one of up to lr in the parameter; with 1e-4 at most lr * 1e-8 / eps per step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)
    embedding = model.get_input_embeddings()
    losses, norms, pad_grads = [], [], []
    for step in range(STEPS):
        ids, labels = batch(step)
        with maybe_loss_parallel(tensor_parallel):
            logits = model(input_ids=ids[rows]).logits
            loss = local_loss(causal_lm_loss(logits, labels[rows]))
            loss.backward()
        norms.append(math.sqrt(sum(float(full(p.grad).pow(2).sum()) for p in model.parameters())))
        if embedding.padding_idx is not None:  # the pad row's gradient (the head's too where tied)
            pad_grads.append(float(full(embedding.weight.grad)[embedding.padding_idx].abs().max()))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return {
        "losses": losses,
        "norms": norms,
        "pad_grads": pad_grads,
        "logits_local": tuple(getattr(logits, "_local_tensor", logits).shape),
    }


def parallel_body(
    family: str,
    tied: bool,
    tp: int,
    sequence_parallel: bool | None,
    recompute: bool | str,
    pad: int | None = None,
) -> dict[str, Any] | None:
    model = tiny_model(family, tied, pad)
    dims = ParallelDims(tp=tp).resolve(dist.get_world_size()).build_mesh("cpu")
    options = ParallelOptions(activation_checkpointing=recompute)
    parallelize_hf(model, dims, options, sequence_parallel=sequence_parallel)
    seen: list[tuple[int, ...]] = []
    layers = model.model.layers
    layers[1].register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    dp_rank, dp = dims.mesh_for("dp").get_local_rank(), dims.dp
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    result = train(model, rows, tensor_parallel=dims.tp_enabled)
    result["between_layers"] = seen[0]
    result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    result["q_proj_local"] = tuple(layers[0].self_attn.q_proj.weight.to_local().shape)
    params = {
        name.replace("._checkpoint_wrapped_module", ""): full(p).detach().clone()
        for name, p in model.named_parameters()
    }
    if dist.get_rank() != 0:
        return None
    return {**result, "params": params}


def compare(
    family: str,
    tied: bool,
    world: int,
    tp: int,
    sequence_parallel: bool | None,
    recompute: bool | str = False,
    pad: int | None = None,
) -> dict[str, Any]:
    ranks = run_distributed(parallel_body, world, family, tied, tp, sequence_parallel, recompute, pad)
    got = ranks[0]
    reference = tiny_model(family, tied, pad)
    expected = train(reference, slice(None), tensor_parallel=False)
    got["expected_pad_grads"] = expected["pad_grads"]
    expected_params = dict(reference.named_parameters())
    got["loss_error"] = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True))
    got["norm_error"] = max(abs(a - b) for a, b in zip(got["norms"], expected["norms"], strict=True))
    assert set(got["params"]) == set(expected_params)
    got["param_error"] = max(
        float((p - expected_params[n].detach()).abs().max()) for n, p in got["params"].items()
    )
    start = tiny_model(family, tied, pad).state_dict()
    got["moved"] = max(float((p.detach() - start[n]).abs().max()) for n, p in expected_params.items())
    return got


# A pad id in the second tp rank's rows (64-127), which the batches hold (4 times over the steps)
PAD = 70


@pytest.mark.parametrize(
    ("family", "tied", "world", "tp", "pad"),
    [
        ("qwen3", False, 2, 2, None),
        ("qwen3", True, 2, 2, None),
        ("llama", False, 2, 2, PAD),
        ("llama", True, 4, 2, PAD),
        # the scaled embeddings (embedding.embedding_scale), Gemma 2 / 3's norms after attention and MLP
        ("gemma", False, 2, 2, PAD),
        ("gemma2", False, 2, 2, None),
        ("gemma3", True, 2, 2, None),
    ],
)
def test_tp_sequence_parallel_matches_one_process(
    family: str, tied: bool, world: int, tp: int, pad: int | None
) -> None:
    got = compare(family, tied, world, tp, sequence_parallel=None, pad=pad)
    assert got["tied"] == tied
    assert got["q_proj_local"] == (4 * 16 // world, HIDDEN)  # heads split over tp, then rows over fsdp
    assert got["logits_local"] == (ROWS * tp // world, SEQ, VOCAB // tp)  # loss parallel: vocabulary-sharded
    assert got["between_layers"] == (ROWS * tp // world, SEQ // tp, HIDDEN)  # sequence parallel
    assert got["moved"] > 1e-3  # the steps changed the parameters
    assert got["loss_error"] <= 1e-5
    assert got["norm_error"] <= 1e-5
    assert got["param_error"] <= 1e-5
    if pad is not None:  # the lookup leaves the pad row alone, as transformers' embedding does
        assert any(bool((batch(step)[0] == pad).any()) for step in range(STEPS))
        assert (
            max(abs(a - b) for a, b in zip(got["pad_grads"], got["expected_pad_grads"], strict=True)) <= 1e-6
        )
        if not tied:  # no gradient at all: the row stays the zeros transformers starts it at
            assert max(got["pad_grads"]) == 0.0
            assert not got["params"]["model.embed_tokens.weight"][pad].any()


def test_tp_without_sequence_parallel_matches_one_process() -> None:
    got = compare("qwen3", False, 2, 2, sequence_parallel=False)
    assert got["between_layers"] == (
        ROWS,
        SEQ,
        HIDDEN,
    )  # the residual stream replicated, as transformers runs
    assert got["logits_local"] == (ROWS, SEQ, VOCAB // 2)
    assert got["loss_error"] <= 1e-5
    assert got["norm_error"] <= 1e-5
    assert got["param_error"] <= 1e-5


@pytest.mark.parametrize(("tp", "recompute"), [(2, True), (2, "selective"), (1, "selective")])
def test_activation_checkpointing_matches_one_process(tp: int, recompute: bool | str) -> None:
    """Recompute replays each layer: without the adapter's use_cache=False the layer appends to the KV cache
    again and attends over twice the positions (selective recompute then fails, also without tp)."""
    got = compare("qwen3", True, 2, tp, sequence_parallel=None, recompute=recompute)
    assert got["between_layers"] == (ROWS * tp // 2, SEQ // tp, HIDDEN)
    assert got["loss_error"] <= 1e-5
    assert got["norm_error"] <= 1e-5
    assert got["param_error"] <= 1e-5


# ----------------------------------------------------------------------------------------------------- GPT-OSS
def gpt_oss_body() -> dict[str, Any] | None:
    from tiny_hf import tiny_causal_lm

    model = tiny_causal_lm("gpt_oss")
    dims = ParallelDims(tp=2).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize_hf(model, dims, ParallelOptions())
    seen: list[tuple[int, ...]] = []
    model.model.layers[1].register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    result = train(model, slice(None), tensor_parallel=True)
    named = dict(model.named_parameters())
    attention = "model.layers.0.self_attn"
    # each parameter's placement on the tp mesh dim, and this rank's shape
    result["tp_layouts"] = {
        name: (
            param.placements[param.device_mesh.mesh_dim_names.index("tp")],
            tuple(param.to_local().shape),
        )
        for name, param in named.items()
        if name.startswith(attention)
        and isinstance(param, DTensor)
        and "tp" in param.device_mesh.mesh_dim_names
    }
    result["between_layers"] = seen[0]
    params = {name: full(p).detach().clone() for name, p in named.items()}
    return {**result, "params": params} if dist.get_rank() == 0 else None


def test_gpt_oss_tp_matches_one_process() -> None:
    """GPT-OSS at tp=2 against the unmodified model (``tiny_hf.reference_run``): its config's tp plan names the
    embedding only, so the adapter splits each attention's heads itself (q/k/v column-parallel, o row-parallel,
    their biases with them: o's added once, after the reduction), each head's sink with its head (``Shard(0)``
    over tp), and runs the MoE block (biased router, biased experts in GPT-OSS's layout) whole on each rank's
    sequence shard. Sliding and full layers, the experts' clamp biting (``tiny_hf.FAMILY_FIELDS``)."""
    from tiny_hf import reference_run, tiny_causal_lm

    got = run_distributed(gpt_oss_body, 2)[0]
    expected = reference_run(tiny_causal_lm("gpt_oss"), STEPS)
    heads, kv_heads, head_dim = 4, 2, 16
    attention = "model.layers.0.self_attn"
    assert got["tp_layouts"] == {
        f"{attention}.sinks": (Shard(0), (heads // 2,)),
        f"{attention}.q_proj.weight": (Shard(0), (heads * head_dim // 2, HIDDEN)),
        f"{attention}.q_proj.bias": (Shard(0), (heads * head_dim // 2,)),
        f"{attention}.k_proj.weight": (Shard(0), (kv_heads * head_dim // 2, HIDDEN)),
        f"{attention}.k_proj.bias": (Shard(0), (kv_heads * head_dim // 2,)),
        f"{attention}.v_proj.weight": (Shard(0), (kv_heads * head_dim // 2, HIDDEN)),
        f"{attention}.v_proj.bias": (Shard(0), (kv_heads * head_dim // 2,)),
        f"{attention}.o_proj.weight": (Shard(1), (HIDDEN, heads * head_dim // 2)),
        f"{attention}.o_proj.bias": (Replicate(), (HIDDEN,)),
    }
    assert got["between_layers"] == (ROWS, SEQ // 2, HIDDEN)  # sequence parallel around the MoE blocks
    assert got["logits_local"] == (ROWS, SEQ, VOCAB // 2)
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(got["norms"], expected["norms"], strict=True)) <= 1e-5
    assert set(got["params"]) == set(expected["params"])
    for name, param in expected["params"].items():
        assert float((got["params"][name] - param).abs().max()) <= 1e-5, name


# --------------------------------------------------------------- gathered styles split by heads (head_split), StableLM
# name -> (family, config overrides, sequence_parallel): every case runs in one launch (head_split_body)
HEAD_SPLIT_CASES: dict[str, tuple[str, dict[str, Any], bool | None]] = {
    # a fused qkv_proj (4 q heads, 2 kv heads: unequal sections) and gate_up_proj, colwise_gather_output
    "phi3": ("phi3", {}, None),
    "phi3_tied_replicated_stream": ("phi3", {"tied": True}, False),
    # q/k norms over all heads' features
    "olmo2": ("olmo2", {}, None),
    "olmo2_replicated_stream": ("olmo2", {}, False),
    # a fused gate_up_proj, biased q/k/v
    "glm4": ("glm4", {}, None),
    # multi-head latent attention, low-rank q (q_a_proj ... q_b_proj) or a full q_proj; a dense layer, an MoE layer
    "deepseek_v3": ("deepseek_v3", {}, None),
    "deepseek_v3_tied_full_q": ("deepseek_v3", {"tied": True, "q_lora_rank": None}, None),
    # the adapter's own plan (family_plans)
    "stablelm": ("stablelm", {}, None),
    "stablelm_tied": ("stablelm", {"tied": True}, None),
}
# what one process holds per layer: 4 heads of 16 (DeepSeek-V3: values of 16), an MLP 128 wide
HEADS_WIDTH, MLP_WIDTH = 4 * 16, 128


def _layout(param: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """A parameter's placement over tp (``"whole"``: not split over tp) and this rank's shape."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    if "tp" in names:
        return repr(param.placements[names.index("tp")]), tuple(param.to_local().shape)
    return "whole", tuple(full(param).shape)


def _record_input(_: nn.Module, args: tuple[Any, ...], *, seen: dict[str, tuple[int, ...]], key: str) -> None:
    inputs = args[0]  # the style's own hooks may have made it a DTensor: this rank's part
    seen.setdefault(key, tuple((inputs.to_local() if isinstance(inputs, DTensor) else inputs).shape))


def head_split_body() -> dict[str, Any] | None:
    from functools import partial

    from tiny_hf import tiny_causal_lm

    results: dict[str, Any] = {}
    for case, (family, overrides, sequence_parallel) in HEAD_SPLIT_CASES.items():
        model = tiny_causal_lm(family, **overrides)
        dims = ParallelDims(tp=2).resolve(dist.get_world_size()).build_mesh("cpu")
        parallelize_hf(model, dims, ParallelOptions(), sequence_parallel=sequence_parallel)
        layer = model.model.layers[0]
        seen: dict[str, tuple[int, ...]] = {}
        for key, module in [
            ("between_layers", model.model.layers[1]),
            ("heads", layer.self_attn.o_proj),  # the attention's output: this rank's heads
            ("mlp", layer.mlp.down_proj),  # this rank's MLP columns (gate * up)
        ]:
            module.register_forward_pre_hook(partial(_record_input, seen=seen, key=key))
        result = train(model, slice(None), tensor_parallel=True)
        result.update(seen)
        result["layouts"] = {
            name.removeprefix("model.layers.0."): _layout(p)
            for name, p in model.named_parameters()
            if name.startswith("model.layers.0.")
        }
        result["attention_config_heads"] = layer.self_attn.config.num_attention_heads
        result["model_config_heads"] = model.config.num_attention_heads
        result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        result["params"] = {name: full(p).detach().clone() for name, p in model.named_parameters()}
        results[case] = result
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def head_split_results() -> dict[str, Any]:
    return run_distributed(head_split_body, 2)[0]


# the layer-0 parameters whose layout shows the translation (placement over tp, this rank's shape)
HEAD_SPLIT_LAYOUTS: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {
    "phi3": {  # transformers' own placement of the fused weights; each rank computes whole heads and halves
        "self_attn.qkv_proj.weight": ("Shard(dim=0)", ((4 + 2 * 2) * 16 // 2, HIDDEN)),
        "self_attn.o_proj.weight": ("Shard(dim=1)", (HIDDEN, HEADS_WIDTH // 2)),
        "mlp.gate_up_proj.weight": ("Shard(dim=0)", (2 * MLP_WIDTH // 2, HIDDEN)),
        "mlp.down_proj.weight": ("Shard(dim=1)", (HIDDEN, MLP_WIDTH // 2)),
    },
    "olmo2": {
        "self_attn.q_proj.weight": ("Shard(dim=0)", (HEADS_WIDTH // 2, HIDDEN)),
        "self_attn.q_norm.weight": ("Shard(dim=0)", (HEADS_WIDTH // 2,)),  # this rank's heads' features
        "self_attn.k_norm.weight": ("Shard(dim=0)", (2 * 16 // 2,)),
    },
    "glm4": {
        "self_attn.q_proj.bias": ("Shard(dim=0)", (HEADS_WIDTH // 2,)),
        "mlp.gate_up_proj.weight": ("Shard(dim=0)", (2 * MLP_WIDTH // 2, HIDDEN)),
    },
    "deepseek_v3": {  # the low-rank path whole, the heads split
        "self_attn.q_a_proj.weight": ("whole", (32, HIDDEN)),
        "self_attn.q_a_layernorm.weight": ("whole", (32,)),
        "self_attn.q_b_proj.weight": ("Shard(dim=0)", (4 * (16 + 8) // 2, 32)),
        "self_attn.kv_a_proj_with_mqa.weight": ("whole", (32 + 8, HIDDEN)),
        "self_attn.kv_a_layernorm.weight": ("whole", (32,)),
        "self_attn.kv_b_proj.weight": ("Shard(dim=0)", (4 * (16 + 16) // 2, 32)),
        "self_attn.o_proj.weight": ("Shard(dim=1)", (HIDDEN, HEADS_WIDTH // 2)),
    },
    "deepseek_v3_tied_full_q": {"self_attn.q_proj.weight": ("Shard(dim=0)", (4 * (16 + 8) // 2, HIDDEN))},
    "stablelm": {
        "self_attn.k_proj.weight": ("Shard(dim=0)", (2 * 16 // 2, HIDDEN)),
        "input_layernorm.bias": ("Replicate()", (HIDDEN,)),
    },
}


@pytest.mark.parametrize("case", list(HEAD_SPLIT_CASES))
def test_gathered_styles_split_by_heads_match_one_process(
    head_split_results: dict[str, Any], case: str
) -> None:
    """Phi-3 (fused qkv and gate_up), OLMo 2 (q/k norms over all heads), GLM-4 (fused gate_up), DeepSeek-V3 (MLA)
    and StableLM (the adapter's plan) at tp=2 against the unmodified model in one process (``tiny_hf.reference_run``,
    6 AdamW steps): each rank computes its heads and MLP columns only, the fused weights keep ``transformers``'
    placement, MLA's low-rank path stays whole."""
    from tiny_hf import reference_run, tiny_causal_lm

    family, overrides, sequence_parallel = HEAD_SPLIT_CASES[case]
    got = head_split_results[case]
    expected = reference_run(tiny_causal_lm(family, **overrides), STEPS)
    assert got["tied"] == overrides.get("tied", False)
    assert got["heads"] == (ROWS, SEQ, HEADS_WIDTH // 2)
    assert got["mlp"] == (ROWS, SEQ, MLP_WIDTH // 2)
    sequence = SEQ if sequence_parallel is False else SEQ // 2
    assert got["between_layers"] == (ROWS, sequence, HIDDEN)
    assert got["logits_local"] == (ROWS, SEQ, VOCAB // 2)
    for name, layout in HEAD_SPLIT_LAYOUTS.get(case, {}).items():
        assert got["layouts"][name] == layout, name
    # Phi-3 reads its q width from the config: its attentions' copy holds this rank's heads, the model's all
    assert (got["attention_config_heads"], got["model_config_heads"]) == (
        (2, 4) if family == "phi3" else (4, 4)
    )
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(got["norms"], expected["norms"], strict=True)) <= 1e-5
    assert set(got["params"]) == set(expected["params"])
    for name, param in expected["params"].items():
        assert float((got["params"][name] - param).abs().max()) <= 1e-5, name
