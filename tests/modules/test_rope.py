import math

import pytest
import torch

from lightning_d9d.modules import RotaryEmbedding, apply_rotary, rope_inverse_frequencies, rotate_half


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Complex-number RoPE in the half-split layout: dims ``i`` and ``i + D/2`` form one complex number."""
    d = x.shape[-1]
    freqs = torch.tensor([1.0 / theta ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    angles = positions.double()[..., None] * freqs  # [T, D/2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.cat((z.real, z.imag), dim=-1)


def test_inverse_frequencies() -> None:
    inv = rope_inverse_frequencies(8, 10000.0)
    expected = torch.tensor([1.0, 10000 ** (-2 / 8), 10000 ** (-4 / 8), 10000 ** (-6 / 8)])
    torch.testing.assert_close(inv, expected)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_inverse_frequencies(7, 10000.0)


def test_rotate_half() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_apply_rotary_matches_complex_rotation() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, max_positions=64, theta=1e6)
    q, k = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16)
    cos, sin = rope(None, 10, torch.float32)
    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    positions = torch.arange(10)
    torch.testing.assert_close(q_rot.double(), reference_rotary(q, positions, 1e6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot.double(), reference_rotary(k, positions, 1e6), rtol=1e-5, atol=1e-5)


def test_explicit_positions_and_relative_property() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=8, max_positions=128, theta=10000.0)
    positions = torch.tensor([[5, 6, 7], [40, 41, 42]])
    cos, sin = rope(positions, 3, torch.float32)
    assert cos.shape == (2, 3, 8)
    q = torch.randn(1, 1, 1, 8).expand(2, 1, 3, 8)
    k = torch.randn(1, 1, 1, 8).expand(2, 1, 3, 8)
    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_rot[0, 0], reference_rotary(q[0, 0], positions[0], 1e4).float())
    # Scores depend on the offset between positions only, and rotation keeps norms.
    scores = (q_rot[:, :, :, None, :] * k_rot[:, :, None, :, :]).sum(-1)
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
    # Default positions are 0..T-1, broadcast over the batch.
    cos0, _ = rope(None, 3, torch.float32)
    torch.testing.assert_close(cos0, rope(torch.arange(3), 3, torch.float32)[0])


def test_tables_are_fp32_and_rebuilt_after_to_empty() -> None:
    with torch.device("meta"):
        rope = RotaryEmbedding(head_dim=8, max_positions=32, theta=10000.0)
    assert rope.cos.is_meta
    rope.to_empty(device="cpu")
    rope.reset_parameters()
    reference = RotaryEmbedding(head_dim=8, max_positions=32, theta=10000.0)
    assert rope.cos.dtype == torch.float32
    assert torch.equal(rope.cos, reference.cos) and torch.equal(rope.sin, reference.sin)
    assert rope.cos[3, 1].item() == pytest.approx(math.cos(3 * 10000 ** (-2 / 8)), abs=1e-6)
    assert "cos" not in rope.state_dict()
    cos, _ = rope(None, 4, torch.bfloat16)
    assert cos.dtype == torch.bfloat16


def test_too_long_sequence_is_refused() -> None:
    rope = RotaryEmbedding(head_dim=8, max_positions=4, theta=10000.0)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        rope(None, 5, torch.float32)
