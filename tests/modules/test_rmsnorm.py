import torch

from lightning_d9d.modules import RMSNorm


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps)


def test_matches_reference_math() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, 32) * 5
    torch.testing.assert_close(
        norm(x).double(), reference_rms_norm(x, norm.weight, 1e-5), rtol=1e-6, atol=1e-6
    )


def test_low_precision_input_is_normalised_in_fp32_and_returned_in_its_dtype() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64).to(torch.bfloat16)
    # Large values: squaring them in bf16 would lose the mean entirely.
    x = (torch.randn(4, 64) * 300).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = reference_rms_norm(x.float(), norm.weight.float(), 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_gradients_flow_to_weight_and_input() -> None:
    norm = RMSNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    assert torch.isfinite(x.grad).all()
