"""Tiny ``transformers`` causal LMs of every family the adapter proves, a batch stream, and the single-process
reference loop the parity tests compare against (the unmodified model, AdamW, optional accumulation and
clipping)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import transformers
from torch import nn

from lightning_d9d.modules.hf_init import init_transformers_model_
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.modules.moe import routers_in, update_expert_bias

VOCAB, HIDDEN, SEQ, ROWS = 128, 64, 8, 4
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
    ),  # routers only (test_hf_routing.py)
    # its router is an nn.Linear (mlp.router.gate), which FP8 must leave alone (test_hf_fp8.py)
    "afmoe": (transformers.AfmoeConfig, transformers.AfmoeForCausalLM),
    # scaled embeddings, sliding and full layers, a logit soft cap that its config leaves None by default
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    # logits soft-capped (final_logit_softcapping), scaled embeddings, soft-capped attention
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    # logits divided by logits_scaling, multipliers on the embeddings, the residuals and the attention
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    # logits multiplied by logit_scale, parallel attention and MLP
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM),
    # attention sinks, biased q/k/v/o, a biased router; experts with biases, gate and up interleaved, a clamped
    # SwiGLU with a sigmoid gain; sliding and full layers
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    # a fused qkv_proj and gate_up_proj (colwise_gather_output in its plan), grouped key/value heads
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    # q/k norms over all heads' features (its plan gathers q/k/v), norms after attention and MLP
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    # a fused gate_up_proj, biased q/k/v, four norms per layer, partial rotary
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
    # multi-head latent attention (low-rank q and kv, mla_kv_a_proj in its plan); a dense layer, then MoE layers
    # with a shared expert
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    # no tp or pp plan in its config (the adapter's own), LayerNorms with biases, partial rotary
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM),
}
META_SEED = 1234
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
# special tokens inside the tiny vocabulary (some families' defaults lie beyond it)
NO_SPECIAL_TOKENS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
FAMILY_FIELDS = {
    "qwen3_moe": MOE,
    "phi3": NO_SPECIAL_TOKENS,
    "olmo2": NO_SPECIAL_TOKENS,
    "glm4": NO_SPECIAL_TOKENS,
    # low-rank q (q_lora_rank; None gives a full q_proj) and kv; every head its own key (no grouping); the
    # rotary dims as head_dim; layer 0 dense, layer 1 MoE (4 experts, a shared one)
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 32},
    # 16 experts: a router width float8 could multiply; layer 0 dense, a shared expert beside the routed ones
    "afmoe": {
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_dense_layers": 1,
        "num_shared_experts": 1,
    },
    # the clamp at 0.5 bites on about a quarter of the experts' gates and half of their ups in batch(0)'s forward
    # (7.0, the default, on none of these small ones); a window shorter than the sequence
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "swiglu_limit": 0.5,
        "sliding_window": 3,
    },
}


def tiny_config(family: str, *, layers: int = 2, tied: bool = False, **overrides: Any) -> Any:
    config_class, _ = FAMILIES[family]
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
        "initializer_range": 0.1,  # larger than the default, so that the heads' gradients are far from zero
        **FAMILY_FIELDS.get(family, {}),
    }
    return config_class(**{**fields, **overrides})


def tiny_model(family: str, *, layers: int = 2, tied: bool = False, **overrides: Any) -> nn.Module:
    """Built on the current device (``meta`` under ``torch.device("meta")``), in training mode."""
    model = FAMILIES[family][1](tiny_config(family, layers=layers, tied=tied, **overrides))
    model.train()
    return model


def tiny_causal_lm(family: str, *, layers: int = 2, tied: bool = False, **overrides: Any) -> nn.Module:
    """The same weights on every call (seeded)."""
    torch.manual_seed(0)
    return tiny_model(family, layers=layers, tied=tied, **overrides)


def meta_initialised(family: str, *, layers: int = 2, **overrides: Any) -> dict[str, torch.Tensor]:
    """The parameters the strategy gives a model built on ``meta`` (``transformers``' own rules, seeded by
    ``META_SEED``), on one process."""
    with torch.device("meta"):
        model = tiny_model(family, layers=layers, **overrides)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the tied modules a tensor each
    init_transformers_model_(model, META_SEED)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def exclude_experts(model: nn.Module, experts: list[int]) -> None:
    """No token chooses ``experts`` (uneven loads, some experts with none): every router's top-k is taken again
    from its probabilities with theirs zeroed, otherwise as ``transformers``' top-k router computes it. The same
    hooks go on the reference and on the parallel run's model."""
    if not experts:
        return
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(partial(_top_k_without, experts=experts))


def _top_k_without(router: nn.Module, args: Any, output: Any, *, experts: list[int]) -> Any:
    logits = output[0]
    probs = torch.softmax(logits, dtype=torch.float, dim=-1).index_fill(
        -1, torch.tensor(experts, dtype=torch.int64), 0.0
    )
    values, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), indices


def batch(
    step: int, *, rows: int = ROWS, seq: int = SEQ, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step``: ``rows`` rows of ``seq`` ids and labels below ``vocab`` (by default the tiny models'
    ``ROWS``, ``SEQ``, ``VOCAB``), the last two labels of each row ignored (as many per row: a mean over rows or
    microbatches is the token mean)."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels[:, -2:] = -100
    return ids, labels


def packed_positions(step: int) -> torch.Tensor:
    """``[ROWS, SEQ]`` positions of batch ``step`` read as packed rows: documents of 1 to 4 tokens, restarting at
    0 at each (rows of several documents, which must not attend each other)."""
    generator = torch.Generator().manual_seed(500 + step)
    rows = []
    for _ in range(ROWS):
        lengths: list[int] = []
        while sum(lengths) < SEQ:
            lengths.append(min(int(torch.randint(1, 5, (1,), generator=generator)), SEQ - sum(lengths)))
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def samples(steps: int, *, packed: bool = False) -> list[dict[str, torch.Tensor]]:
    """The rows of ``batch(0) .. batch(steps - 1)`` in order, for a DataLoader of batch size ``ROWS``; with
    ``packed`` their ``position_ids`` too (:func:`packed_positions`)."""
    rows = []
    for step in range(steps):
        ids, labels = batch(step)
        rows += [{"input_ids": ids[r], "labels": labels[r]} for r in range(ROWS)]
        if packed:
            for r, positions in enumerate(packed_positions(step)):
                rows[-ROWS + r]["position_ids"] = positions
    return rows


def optimizer_for(parameters: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    # eps well above the gradients' rounding noise (~1e-8 here: sums over other orders of ranks and shards):
    # Adam steps an entry by about lr * g / (|g| + eps), which with the default eps=1e-8 turns a difference in the
    # last bits of a near-zero g into one of up to lr in the parameter; with 1e-4 at most lr * 1e-8 / eps per step
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.1, eps=1e-4)


def reference_run(
    model: nn.Module,
    batches: int,
    *,
    accumulate: int = 1,
    clip: float | None = None,
    bias_rate: float | None = None,
    packed: bool = False,
) -> dict[str, Any]:
    """One process, the unmodified model: per batch the loss, per optimizer step the gradient norm before
    clipping; the parameters at the end, and the validation loss over the first two batches. ``bias_rate``:
    after every optimizer step the routers' selection biases move by it (the model's routers must have one:
    ``lightning_d9d.models.hf.add_selection_bias``), as ``ExpertLoadBalancing`` does. ``packed``: the batches
    as packed rows (:func:`packed_positions`; no cache, so that transformers builds the documents' mask)."""

    def logits(index: int) -> torch.Tensor:
        ids = batch(index)[0]
        if packed:
            return model(input_ids=ids, position_ids=packed_positions(index), use_cache=False).logits
        return model(input_ids=ids).logits

    optimizer = optimizer_for(model.parameters())
    losses, norms = [], []
    for index in range(batches):
        labels = batch(index)[1]
        loss = causal_lm_loss(logits(index), labels)
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if (index + 1) % accumulate:
            continue
        norms.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters())))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if bias_rate is not None:
            update_expert_bias(routers_in(model), bias_rate)
    model.eval()
    with torch.no_grad():
        val = [float(causal_lm_loss(logits(i), batch(i)[1])) for i in range(2)]
    model.train()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    biases = {
        name: module.expert_bias.detach().clone()
        for name, module in model.named_modules()
        if getattr(module, "expert_bias", None) is not None
    }
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "biases": biases,
        "val_loss": sum(val) / len(val),
    }
