"""``MasterWeightAdamW``'s Triton step on one CUDA GPU: equal to its reference (torch's AdamW, operation for
operation) at the size of an MoE layer's expert weights, the bf16 copy exactly the master rounded; and the
optimizer in the strategy's run takes it. Once this passes, ``lightning_d9d.kernels.adamw.ADAMW_MASTER_GPU_CHECKED``
may be set (``auto`` then runs the kernel on CUDA)."""

from __future__ import annotations

import pytest
import torch

from lightning_d9d.kernels.adamw import AdamWHyper, adamw_master_step_reference, adamw_master_step_triton
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.optim import MasterWeightAdamW

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("numel", [64 * 1024 * 384 + 7, 1000])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_step_equals_the_reference(numel: int, scaled: bool) -> None:
    generator = torch.Generator(device="cuda").manual_seed(numel)
    master = torch.randn(numel, device="cuda", generator=generator)
    grad = torch.randn(numel, device="cuda", generator=generator).to(torch.bfloat16)
    exp_avg = torch.randn(numel, device="cuda", generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, device="cuda", generator=generator) * 0.01
    hyper = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7)
    scale = torch.tensor([0.3], device="cuda") if scaled else None
    param_like = torch.full((numel,), float("nan"), device="cuda", dtype=torch.bfloat16)
    expected = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq, param_like)]
    got = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq, param_like)]
    adamw_master_step_reference(*expected, hyper, scale)
    adamw_master_step_triton(*got, hyper, scale)
    for name, g, e in zip(("master", "grad", "exp_avg", "exp_avg_sq"), got, expected, strict=False):
        # fp32 rounding of multiply-adds fused or not: one fp32 step at the tensor's scale
        torch.testing.assert_close(g, e, rtol=1e-6, atol=2**-23 * float(e.float().abs().max()), msg=name)
    assert torch.equal(got[4], got[0].to(torch.bfloat16))  # the bf16 copy is the master rounded (no NaN left)


def test_a_step_over_a_model_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer over a model on the GPU, the kernel forced: its bf16 parameters become their masters rounded
    and training lowers the loss on a repeated batch."""
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", "triton")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny()).cuda()
    model.init_weights()
    optimizer = MasterWeightAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, Qwen3Config.tiny().vocab_size, (4, 33), device="cuda")
    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    for param in model.parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param.detach(), optimizer.state[param]["master"].to(torch.bfloat16))
