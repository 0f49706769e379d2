"""Qwen3-MoE against transformers' ``Qwen3MoeForCausalLM`` on CPU: weights through our HF mapping, logits,
router choices, gradients (with the load-balancing loss), plus config, init, sizes, plan and pipeline parts."""

from collections.abc import Mapping

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules import causal_lm_loss
from lightning_d9d.modules.moe import MoE, TopKRouter
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.state.hf import QWEN3_MOE

GRAD_CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.gate.weight",  # the router: the aux loss's gradient lands here
    "model.layers.1.mlp.down_proj.weight",  # dense layer
    "model.layers.2.mlp.gate.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def to_ours(hf_state: Mapping[str, torch.Tensor], config: Qwen3MoeConfig) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict (fused experts) through our HF mapping."""
    mapper = QWEN3_MOE.from_hf(config.to_hf_dict(), "fused")
    out: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        out.update(mapper.apply({key: hf_state[key] for key in group.inputs}))
    return out


def hf_pair(config: Qwen3MoeConfig) -> tuple[torch.nn.Module, Qwen3MoeForCausalLM]:
    torch.manual_seed(0)
    hf_config = config.to_hf_config()
    hf_config._attn_implementation = "eager"
    hf = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():  # HF's norms start at 1: randomise them so that a swapped norm would show
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            if "mlp.gate.weight" in name:  # spread the router logits: distinct, decisive top-k
                param.normal_(0.0, 0.5)
    ours = Qwen3MoeForCausalLM(config)
    ours.load_state_dict(to_ours(hf.state_dict(), config), strict=True)
    return hf, ours


def router_choices(model: torch.nn.Module, router_type: type, ids: torch.Tensor) -> list[torch.Tensor]:
    """The top-k expert indices each router picks, in layer order."""
    chosen: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
        indices = output.expert_indices if router_type is TopKRouter else output[2]  # type: ignore[attr-defined]
        chosen.append(indices)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router_type)]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return chosen


def test_logits_router_choices_and_gradients_match_transformers() -> None:
    # Layer 1 dense (mlp_only_layers); with decoder_sparse_step=1 layers 0 and 2 are sparse.
    config = Qwen3MoeConfig.tiny(output_router_logits=False)
    hf, ours = hf_pair(config)
    assert [type(ours.model.layers[str(i)].mlp).__name__ for i in range(3)] == ["MoE", "SwiGLU", "MoE"]
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    theirs = router_choices(hf, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter, ids)
    mine = router_choices(ours, TopKRouter, ids)
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    used = torch.cat(mine).flatten().bincount(minlength=config.num_experts)
    assert (used > 0).sum() >= 4  # several experts really take part

    hf_logits = hf(input_ids=ids).logits
    logits = ours(ids)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-5)
    causal_lm_loss(hf_logits[:, :-1], ids[:, 1:]).backward()
    causal_lm_loss(logits[:, :-1], ids[:, 1:]).backward()
    _assert_gradients_match(hf, ours, config)


def _assert_gradients_match(hf: torch.nn.Module, ours: Qwen3MoeForCausalLM, config: Qwen3MoeConfig) -> None:
    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    for name in GRAD_CHECKED:
        if name not in our_params:
            continue
        hf_grad, our_grad = hf_params[name].grad, our_params[name].grad
        assert hf_grad is not None and our_grad is not None, name
        torch.testing.assert_close(our_grad, hf_grad, rtol=1e-5, atol=1e-5, msg=name)
    # The stacked experts' gradients, through the same mapping as the weights.
    hf_state = dict(hf.state_dict())
    for name, param in hf.named_parameters():
        if ".experts." in name:
            assert param.grad is not None, name
            hf_state[name] = param.grad
    expected = to_ours(hf_state, config)
    for name, param in our_params.items():
        if ".experts." in name:
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_load_balancing_loss_gradient_matches_transformers() -> None:
    """One sparse layer (transformers averages over sparse layers before multiplying, we average the layers'
    losses: equal with one). Training mode on both; the aux loss rides on our backward, HF adds it to its loss."""
    config = Qwen3MoeConfig.tiny(mlp_only_layers=[0, 1], router_aux_loss_coef=0.5)
    hf, ours = hf_pair(config)
    hf.train()
    ours.train()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    logits = ours(ids)
    # transformers' loss shifts labels inside; the same mean over T-1 positions here.
    causal_lm_loss(logits[:, :-1], ids[:, 1:]).backward()
    router_loss = ours.router_loss()
    assert router_loss is not None
    torch.testing.assert_close(
        router_loss, config.router_aux_loss_coef * out.aux_loss.detach(), rtol=1e-5, atol=1e-6
    )
    _assert_gradients_match(hf, ours, config)


def test_router_loss_is_the_mean_of_the_sparse_layers_losses() -> None:
    """Two sparse layers: the coefficient is shared out, each layer's loss is transformers' for that layer."""
    config = Qwen3MoeConfig.tiny(router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    hf, ours = hf_pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        router_logits = hf(input_ids=ids, output_router_logits=True).router_logits
        ours.train()
        ours(ids)
    assert len(router_logits) == 2
    aux = [
        load_balancing_loss_func((logits,), config.num_experts, config.num_experts_per_tok)
        for logits in router_logits
    ]
    z = [torch.logsumexp(logits, dim=-1).square().mean() for logits in router_logits]
    expected = (0.5 * sum(aux) + 0.25 * sum(z)) / 2
    torch.testing.assert_close(ours.router_loss(), expected, rtol=1e-5, atol=1e-6)
    # Off unless output_router_logits (as in transformers), z-loss apart.
    quiet = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(output_router_logits=False)).train()
    quiet(ids)
    assert quiet.router_loss() is None


def test_config_round_trip_and_interleaving_rule() -> None:
    config = Qwen3MoeConfig.tiny(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert config.sparse_layers == [1, 5]
    hf_config = config.to_hf_config()
    hf = transformers.Qwen3MoeForCausalLM(hf_config)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == config.sparse_layers
    assert Qwen3MoeConfig.from_hf_dict(hf_config) == config
    assert Qwen3MoeConfig.from_hf_dict(config.to_hf_dict()) == config
    ours = Qwen3MoeForCausalLM(config)
    assert [k for k, layer in ours.model.layers.items() if isinstance(layer.mlp, MoE)] == ["1", "5"]
    assert set(ours.state_dict()) == set(to_ours(hf.state_dict(), config))
    with pytest.raises(ValueError, match="model_type is 'qwen3'"):
        Qwen3MoeConfig.from_hf_dict({"model_type": "qwen3"})


def test_parameter_counts_and_flops() -> None:
    for tied in (False, True):
        config = Qwen3MoeConfig.tiny(tie_word_embeddings=tied)
        model = Qwen3MoeForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == config.num_params()
        # Active: each sparse layer's unused experts (E - k of them, 3 matrices each) leave the count.
        unused = len(config.sparse_layers) * (config.num_experts - config.num_experts_per_tok)
        inactive = unused * 3 * config.hidden_size * config.moe_intermediate_size
        assert config.num_params(active=True) == config.num_params() - inactive
    config = Qwen3MoeConfig.tiny()
    embedding = config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 100
    expected = 6 * (config.num_params(active=True) - embedding) + attention
    assert Qwen3MoeForCausalLM(config).num_flops_per_token(100) == expected


def test_init_is_seeded_by_name_and_independent_of_construction_path() -> None:
    config = Qwen3MoeConfig.tiny()
    with torch.device("meta"):
        meta = Qwen3MoeForCausalLM(config)
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    eager = Qwen3MoeForCausalLM(config)
    eager.init_weights(7)
    for (name, a), b in zip(meta.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    experts = meta.model.layers["0"].mlp.experts
    # N(0, initializer_range) as transformers, not GroupedExperts' own uniform default
    assert abs(float(experts.gate_up_proj.detach().std()) - config.initializer_range) < 0.005
    assert not torch.equal(experts.gate_up_proj, meta.model.layers["2"].mlp.experts.gate_up_proj)  # per name
    router = meta.model.layers["0"].mlp.gate
    assert int(router.expert_load.abs().sum()) == 0  # to_empty garbage cleared
    other = Qwen3MoeForCausalLM(config)
    other.init_weights(8)
    assert not torch.equal(other.model.layers["0"].mlp.gate.weight, router.weight)


# cp and tp are planned: tests/strategies/test_expert_parallel_parity.py, test_moe_tensor_parallel.py
@pytest.mark.parametrize("name", ["pp"])
def test_parallelize_refuses_unimplemented_degrees(name: str) -> None:
    dims = ParallelDims(**{name: 2}).resolve(2)
    with pytest.raises(NotImplementedError, match=f"Qwen3MoeForCausalLM: {name}=2"):
        Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny()).parallelize(dims, ParallelOptions())


def test_expert_parallel_needs_ep_to_divide_the_experts() -> None:
    # refused before any mesh or collective is touched (the dims here have no mesh at all)
    dims = ParallelDims(ep=3).resolve(3)
    with pytest.raises(ValueError, match=r"ep \(3\) must divide the number of experts \(8\)"):
        Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny()).parallelize(dims, ParallelOptions())


def test_pipeline_stages_chain_to_the_whole_model() -> None:
    config = Qwen3MoeConfig.tiny()
    whole = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = whole(ids)
    hidden = ids
    for layer_ids, first, last in (([0], True, False), ([1, 2], False, True)):
        part = Qwen3MoeForCausalLM(config).eval()
        part.load_state_dict(whole.state_dict())
        part.pipeline_keep(layer_ids, first=first, last=last)
        stage = part.pipeline_stage(layer_ids, first=first, last=last)
        with torch.no_grad():
            hidden = stage(hidden)
    torch.testing.assert_close(hidden, expected, rtol=1e-6, atol=1e-6)
