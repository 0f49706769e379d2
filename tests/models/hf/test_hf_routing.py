"""A transformers MoE model's routers under the adapter: counting their load leaves the model's numbers as they
are; the selection bias chooses the experts and keeps the weights the unbiased probabilities; built on meta, the
counters and the bias start at zero; the Hugging Face files stay the class's own (the bias in the training
checkpoint only); a model without routers is refused. The bias trained under ep, tp x dp_shard and pp against one
process: test_hf_expert_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import MOE, VOCAB, tiny_causal_lm, tiny_model

from lightning_d9d.models.hf import add_selection_bias, count_router_load, hf_routers
from lightning_d9d.modules.hf_init import init_transformers_model_
from lightning_d9d.modules.moe import counts_expert_load, paused_load_counting, routers_in, update_expert_bias
from lightning_d9d.state.hf import load_hf, save_hf
from lightning_d9d.state.reader import CheckpointReader

IDS = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(5))


def router_outputs(model: torch.nn.Module) -> list[tuple[torch.Tensor, ...]]:
    seen: list[tuple[torch.Tensor, ...]] = []
    for router in hf_routers(model).values():
        router.register_forward_hook(lambda _module, _args, output: seen.append(output))
    model(input_ids=IDS)
    return list(seen)  # this forward's: the hooks stay


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_counting_keeps_the_model_s_numbers_and_counts_every_slot(norm_topk_prob: bool) -> None:
    reference = tiny_causal_lm("qwen3_moe", norm_topk_prob=norm_topk_prob)
    model = tiny_causal_lm("qwen3_moe", norm_topk_prob=norm_topk_prob)
    assert sorted(count_router_load(model)) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    expected, got = router_outputs(reference), router_outputs(model)
    for theirs, ours in zip(expected, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
    assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)
    routers = routers_in(model)
    assert len(routers) == 2 and all(r.expert_bias is None for r in routers)
    # two training forwards so far (router_outputs, then the logits above): every token's top k slots per layer
    slots = 2 * IDS.numel() * MOE["num_experts_per_tok"]
    for router, (_, _, indices) in zip(routers, got, strict=True):
        assert int(router.expert_load.sum()) == slots
        assert torch.equal(router.expert_load, 2 * torch.bincount(indices.flatten(), minlength=4))
    model.eval()
    model(input_ids=IDS)
    assert int(routers[0].expert_load.sum()) == slots  # evaluation counts nothing
    model.train()
    with paused_load_counting(model):
        model(input_ids=IDS)
    assert int(routers[0].expert_load.sum()) == slots  # nor a paused forward (pipeline shape inference)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_the_selection_bias_chooses_and_the_weights_stay_unbiased(norm_topk_prob: bool) -> None:
    reference = tiny_causal_lm("qwen3_moe", norm_topk_prob=norm_topk_prob)
    model = tiny_causal_lm("qwen3_moe", norm_topk_prob=norm_topk_prob)
    add_selection_bias(model)
    assert all(r.expert_bias is not None and not r.expert_bias.any() for r in routers_in(model))
    # a zero bias: the class's own numbers
    assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)
    assert "mlp.gate.expert_bias" in "".join(model.state_dict())  # training state, saved
    for router in routers_in(model):
        assert router.expert_bias is not None
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 chosen by every token
    for logits, weights, indices in router_outputs(model):
        assert bool((indices == 3).any(dim=-1).all())
        probs = torch.softmax(logits.float(), dim=-1)
        unbiased = probs.gather(1, indices)
        if norm_topk_prob:
            unbiased = unbiased / unbiased.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(weights, unbiased, rtol=0, atol=0)
        # the other slot is the best of the rest, by the unbiased probabilities
        best_rest = torch.topk(probs.index_fill(-1, torch.tensor([3]), -1.0), 1, dim=-1).indices
        assert bool((indices == best_rest).any(dim=-1).all())
    assert not torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_the_update_moves_the_bias_towards_the_idle_experts() -> None:
    model = tiny_causal_lm("qwen3_moe")
    add_selection_bias(model)
    model(input_ids=IDS)
    routers = routers_in(model)
    loads = update_expert_bias(routers, 0.01).to(torch.float32)
    for router, load in zip(routers, loads, strict=True):
        assert router.expert_bias is not None
        torch.testing.assert_close(router.expert_bias, 0.01 * torch.sign(load.mean() - load))
        assert not router.expert_load.any()


def test_a_router_that_always_renormalises_in_fp32_is_read_off_its_class() -> None:
    # Mixtral's router renormalises without a flag and returns fp32 weights for bf16 logits
    reference = tiny_causal_lm("mixtral", layers=1).to(torch.bfloat16)
    model = tiny_causal_lm("mixtral", layers=1).to(torch.bfloat16)
    add_selection_bias(model)
    (router,) = hf_routers(model).values()
    assert router._d9d_weighting == "renormalised"
    assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_built_on_meta_the_counters_and_the_bias_start_at_zero() -> None:
    with torch.device("meta"):
        model = tiny_model("qwen3_moe")
    add_selection_bias(model)
    model.to_empty(device="cpu")
    for router in routers_in(model):
        router.expert_load.fill_(7)  # what the allocation held
        assert router.expert_bias is not None
        router.expert_bias.fill_(float("nan"))
    assert init_transformers_model_(model, 1234) == []  # nothing left unwritten
    assert len(routers_in(model)) == model.config.num_hidden_layers
    for router in routers_in(model):
        assert counts_expert_load(router)
        assert (
            not router.expert_load.any() and router.expert_bias is not None and not router.expert_bias.any()
        )
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_a_model_without_routers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM: add_selection_bias found no MoE router"):
        add_selection_bias(tiny_causal_lm("qwen3"))
    assert count_router_load(tiny_causal_lm("qwen3")) == []


def set_biases(model: torch.nn.Module, value: float) -> None:
    add_selection_bias(model)
    for router in routers_in(model):
        assert router.expert_bias is not None
        router.expert_bias.fill_(value)


def test_the_hugging_face_files_are_the_class_s_own_and_the_bias_stays(tmp_path: Path) -> None:
    trained = tiny_causal_lm("qwen3_moe")
    set_biases(trained, 0.5)
    save_hf(trained, tmp_path)
    keys = CheckpointReader(tmp_path).keys()
    assert not [key for key in keys if "bias" in key]  # transformers' Qwen3-MoE has no field for it
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(tiny_causal_lm("qwen3_moe").state_dict())
    into = tiny_model("qwen3_moe")
    set_biases(into, 0.25)
    load_hf(into, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(into.parameters(), trained.parameters(), strict=True))
    assert all(r.expert_bias is not None and bool((r.expert_bias == 0.25).all()) for r in routers_in(into))
