import pytest
import torch
import transformers

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules import causal_lm_loss
from lightning_d9d.plans import ParallelOptions

GRAD_CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_norm.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def hf_pair(config: Qwen3Config, attn: str = "sdpa") -> tuple[torch.nn.Module, Qwen3ForCausalLM]:
    torch.manual_seed(0)
    hf_config = config.to_hf_config()
    hf_config._attn_implementation = attn
    hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    # HF's norms start at 1: randomise them so that a swapped q_norm/k_norm or layer norm would show.
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    ours = Qwen3ForCausalLM(config)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_gradients_match_transformers(tied: bool) -> None:
    config = Qwen3Config.tiny(tie_word_embeddings=tied, num_hidden_layers=3)
    hf, ours = hf_pair(config, attn="sdpa" if tied else "eager")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = torch.randint(0, config.vocab_size, (2, 24))
    hf_logits = hf(input_ids=ids).logits
    logits = ours(ids)
    assert logits.shape == (2, 24, config.vocab_size)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-5)

    causal_lm_loss(hf_logits[:, :-1], ids[:, 1:]).backward()
    causal_lm_loss(logits[:, :-1], ids[:, 1:]).backward()
    hf_params, our_params = (
        dict(hf.named_parameters(remove_duplicate=False)),
        dict(ours.named_parameters(remove_duplicate=False)),
    )
    for name in GRAD_CHECKED:
        hf_grad, our_grad = hf_params[name].grad, our_params[name].grad
        assert hf_grad is not None and our_grad is not None, name
        torch.testing.assert_close(our_grad, hf_grad, rtol=1e-5, atol=1e-5, msg=name)


def test_explicit_position_ids_match_transformers() -> None:
    config = Qwen3Config.tiny()
    hf, ours = hf_pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    positions = torch.arange(100, 108).repeat(2, 1)
    positions[1] += 37
    expected = hf(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(ours(ids, positions), expected, rtol=1e-5, atol=1e-5)
    # Default positions are 0..T-1.
    torch.testing.assert_close(ours(ids), ours(ids, torch.arange(8).repeat(2, 1)))


def test_parameter_names_and_counts() -> None:
    for tied in (False, True):
        config = Qwen3Config.tiny(tie_word_embeddings=tied)
        model = Qwen3ForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == config.num_params()
        assert set(model.state_dict()) == set(
            transformers.Qwen3ForCausalLM(config.to_hf_config()).state_dict()
        )
    biased = Qwen3Config.tiny(attention_bias=True)
    assert sum(p.numel() for p in Qwen3ForCausalLM(biased).parameters()) == biased.num_params()
    big = Qwen3Config.qwen3_0_6b()
    with torch.device("meta"):
        meta = Qwen3ForCausalLM(big)
    assert sum(p.numel() for p in meta.parameters()) == big.num_params() == 596_049_920
    assert big.num_params(include_embedding=False) == 596_049_920  # the tied head is a matmul: it counts
    decoder = big.num_params() - big.vocab_size * big.hidden_size
    assert 0.43e9 < decoder < 0.45e9


def test_config_round_trip_through_transformers() -> None:
    for config in (
        Qwen3Config.tiny(),
        Qwen3Config.qwen3_0_6b(),
        Qwen3Config.tiny(rope_theta=5e5, rms_norm_eps=1e-5),
    ):
        hf_config = config.to_hf_config()
        assert Qwen3Config.from_hf_dict(hf_config) == config
        assert Qwen3Config.from_hf_dict(hf_config.to_dict()) == config
    real = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    assert Qwen3Config.from_hf_dict(real) == Qwen3Config.qwen3_0_6b()
    legacy = {**Qwen3Config.tiny().to_hf_dict(), "rope_theta": 123.0}
    assert Qwen3Config.from_hf_dict(legacy).rope_theta == 123.0
    with pytest.raises(NotImplementedError, match="sliding"):
        Qwen3Config.from_hf_dict({**legacy, "use_sliding_window": True})
    with pytest.raises(NotImplementedError, match="rope_type='yarn'"):
        Qwen3Config.from_hf_dict({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"):
        Qwen3Config.tiny(num_key_value_heads=3)


def test_init_is_seeded_by_name_and_independent_of_construction_path() -> None:
    config = Qwen3Config.tiny(tie_word_embeddings=True)
    torch.manual_seed(11)
    a = Qwen3ForCausalLM(config)
    b = Qwen3ForCausalLM(config)
    b.init_weights(11)
    with torch.device("meta"):
        c = Qwen3ForCausalLM(config)
    c.to_empty(device="cpu")
    c.init_weights(11)
    assert c.lm_head.weight is c.model.embed_tokens.weight  # to_empty must not untie the head
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), name
    assert torch.equal(a.model.rotary_emb.cos, c.model.rotary_emb.cos)
    d = Qwen3ForCausalLM(config)
    d.init_weights(12)
    assert not torch.equal(d.model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(config.hidden_size))
    std = a.model.layers["0"].mlp.up_proj.weight.std().item()
    assert abs(std - config.initializer_range) < 0.002
    # Different names draw different values even for same-shaped tensors.
    assert not torch.equal(a.model.layers["0"].mlp.up_proj.weight, a.model.layers["1"].mlp.up_proj.weight)
    bf16 = Qwen3ForCausalLM(config).to(torch.bfloat16)
    bf16.init_weights(11)
    assert torch.equal(bf16.lm_head.weight, a.lm_head.weight.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["ep", "pp"])
def test_parallelize_refuses_unimplemented_degrees(name: str) -> None:
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    with pytest.raises(NotImplementedError, match=f"Qwen3ForCausalLM: {name}=2 is not implemented yet"):
        model.parallelize(ParallelDims(**{name: 2}), ParallelOptions())


def test_flops_per_token() -> None:
    config = Qwen3Config.qwen3_0_6b()
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    n = 28 * (1024 * 2048 * 2 + 1024 * 1024 * 2 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024) + 1024 + 151936 * 1024
    assert model.num_flops_per_token(4096) == 6 * n + 12 * 28 * 16 * 128 * 4096
