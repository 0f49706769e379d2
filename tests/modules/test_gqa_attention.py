import math

import pytest
import torch

from lightning_d9d.modules import Attention, RotaryEmbedding, SwiGLU, apply_rotary, repeat_kv


def reference_attention(
    module: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Plain softmax attention, one head at a time, with an explicit causal mask."""
    b, t, _ = x.shape
    d = module.head_dim
    q = module.q_proj(x).view(b, t, module.num_heads, d)
    k = module.k_proj(x).view(b, t, module.num_kv_heads, d)
    v = module.v_proj(x).view(b, t, module.num_kv_heads, d).transpose(1, 2)
    if module.q_norm is not None and module.k_norm is not None:
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    group = module.num_heads // module.num_kv_heads
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    heads = []
    for h in range(module.num_heads):
        scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, h // group])
    return module.o_proj(torch.stack(heads, dim=2).reshape(b, t, -1))


@pytest.mark.parametrize("repeat_kv_heads", [False, True], ids=["sdpa_gqa", "repeated_kv"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (4, 1)])
def test_matches_reference(qk_norm: bool, heads: int, kv_heads: int, repeat_kv_heads: bool) -> None:
    torch.manual_seed(0)
    attn = Attention(32, heads, kv_heads, 8, qk_norm=qk_norm)
    attn.repeat_kv_heads = repeat_kv_heads
    if qk_norm:
        with torch.no_grad():
            assert attn.q_norm is not None and attn.k_norm is not None
            attn.q_norm.weight.normal_()
            attn.k_norm.weight.normal_()
    rope = RotaryEmbedding(8, 64, 10000.0)
    x = torch.randn(2, 9, 32)
    cos, sin = rope(None, 9, x.dtype)
    torch.testing.assert_close(
        attn(x, cos, sin), reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5
    )


def test_names_and_shapes() -> None:
    attn = Attention(32, 4, 2, 16)
    names = {name for name, _ in attn.named_parameters()}
    assert names == {
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "q_norm.weight",
        "k_norm.weight",
    }
    assert attn.q_proj.weight.shape == (64, 32) and attn.k_proj.weight.shape == (32, 32)
    assert {n for n, _ in Attention(32, 4, 2, 16, qk_norm=False, bias=True).named_parameters()} == {
        f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")
    }
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"):
        Attention(32, 4, 3, 8)


def test_repeat_kv() -> None:
    x = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(repeat_kv(x, 2), x.repeat_interleave(2, dim=1))
    assert repeat_kv(x, 1) is x


def test_swiglu() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(16, 24)
    x = torch.randn(3, 16)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)
    assert {n for n, _ in mlp.named_parameters()} == {
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    }
