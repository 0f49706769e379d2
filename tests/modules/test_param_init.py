import torch

from lightning_d9d.modules import (
    canonical_param_name,
    init_param_,
    normal_fill,
    ones_fill,
    param_seed,
    zeros_fill,
)


def test_seed_is_stable_and_ignores_wrappers() -> None:
    # A fixed value: changing the derivation would silently change every model's initial weights.
    assert param_seed(0, "model.norm.weight") == param_seed(0, "model.norm.weight")
    assert param_seed(1234, "lm_head.weight") == 6639704449598927881
    wrapped = "model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.up_proj.weight"
    assert canonical_param_name(wrapped) == "model.layers.0.mlp.up_proj.weight"
    assert param_seed(7, wrapped) == param_seed(7, "model.layers.0.mlp.up_proj.weight")
    assert param_seed(7, "a") != param_seed(8, "a") and param_seed(7, "a") != param_seed(7, "b")
    assert 0 <= param_seed(2**70, "x") < 2**63


def test_init_param_is_deterministic_dtype_aware_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a = torch.empty(64, 32)
    b = torch.empty(64, 32, dtype=torch.bfloat16)
    init_param_(a, "w", 3, normal_fill(0.02))
    init_param_(b, "w", 3, normal_fill(0.02))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.to(torch.bfloat16), b)
    assert abs(a.std().item() - 0.02) < 0.003
    c = torch.empty(64, 32)
    init_param_(c, "w2", 3, normal_fill(0.02))
    assert not torch.equal(a, c)
    init_param_(c, "norm", 3, ones_fill)
    assert torch.equal(c, torch.ones_like(c))
    init_param_(c, "bias", 3, zeros_fill)
    assert not c.any()
