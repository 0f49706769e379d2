"""The tensor- and context-parallel code paths on one CUDA GPU, in bf16 over NCCL (a one-rank group: one GPU
allows degree 1 only; degree 2 belongs to the two-GPU runs). Run on a CUDA GPU: ``pytest -m gpu``.

- torch's ring attention (``TorchRingAttention``, the ``"auto"`` choice on CUDA) and our portable all-gather
  path against fp32 causal attention of the whole sequence, forward and the gradients of q, k and v, at the
  benchmark's attention shape (grouped-query heads 16/8, head dim 128, sequence 4096);
- Qwen3 with the tensor plan (DTensor parameters, sequence parallelism, vocabulary-parallel head and loss
  parallel) and the context plan with torch's ring attention, against the same model without plans;
- packed rows under the context plan's ``"auto"`` (torch's ring kernels take no mask: the all-gather path takes
  them) against the plain model, fp32; ``"torch_ring"`` by name refuses them.

Errors are ``||out - ref|| / ||ref||``. bf16 keeps 8 bits of mantissa (a rounding error of 2^-9 = 2e-3 per
element); sums over 128-4096 terms and the softmax of bf16 scores put whole-tensor errors near 1e-2 at most, so
the band is 2e-2. A wrong result (attention without the causal mask) is ~1 off and must fail it.

Measured on an H200 (torch 2.11): both attention paths 3.4e-3 (output), 4.4e-3 / 4.7e-3 / 4.0e-3
(dq / dk / dv); Qwen3 with both plans: the same loss to 5 digits, largest gradient error 5.8e-3.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import free_port

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.models.qwen3 import tensor_plan
from lightning_d9d.modules.attention import document_attention
from lightning_d9d.modules.context_attention import (
    AllGatherAttention,
    LoadBalancedSplit,
    TorchRingAttention,
    context_attention,
)
from lightning_d9d.modules.documents import document_causal_mask, document_ids
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import local_loss, maybe_loss_parallel, parallelize_context, parallelize_tensor

pytestmark = pytest.mark.gpu

BF16_BAND = 2e-2


@pytest.fixture(scope="module")
def nccl() -> Iterator[ParallelDims]:
    """A one-rank NCCL group and a (cp=1, tp=1) mesh on the GPU."""
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda:0"),
    )
    try:
        yield ParallelDims(dp_shard=1).resolve(1).build_mesh("cuda")
    finally:
        dist.destroy_process_group()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def test_ring_and_all_gather_attention_equal_causal_attention_in_bf16(nccl: ParallelDims) -> None:
    torch.manual_seed(0)
    batch, q_heads, kv_heads, seq, head_dim = 2, 16, 8, 4096, 128
    q = torch.randn(batch, q_heads, seq, head_dim, device="cuda")
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda")
    v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda")
    grad_out = torch.randn(batch, q_heads, seq, head_dim, device="cuda")

    def run(attend, dtype: torch.dtype) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        leaves = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(grad_out.to(dtype))
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    def causal(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)

    def unmasked(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)

    cp_mesh = nccl.mesh_for("cp")
    split = LoadBalancedSplit(1, 0)
    chosen = context_attention(split, cp_mesh, "auto")
    assert isinstance(chosen, TorchRingAttention)  # "auto" on a CUDA mesh
    expected = run(causal, torch.float32)
    paths = {"torch_ring": chosen, "all_gather": AllGatherAttention(split, cp_mesh.get_group())}
    for name, attend in paths.items():
        errors = [relative_error(a, e) for a, e in zip(run(attend, torch.bfloat16), expected, strict=True)]
        print(f"{name}: out, dq, dk, dv relative errors {[f'{e:.2e}' for e in errors]}")
        assert max(errors) <= BF16_BAND, (name, errors)
    wrong = relative_error(run(unmasked, torch.bfloat16)[0], expected[0])
    assert wrong > 10 * BF16_BAND, wrong  # the band can fail


def test_qwen3_with_tensor_and_ring_context_plans_equals_the_plain_model_in_bf16(nccl: ParallelDims) -> None:
    torch.manual_seed(0)
    config = Qwen3Config.tiny(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
    )
    with torch.device("cuda"):
        plain = Qwen3ForCausalLM(config).to(torch.bfloat16)
    planned = copy.deepcopy(plain)
    parallelize_tensor(
        planned, nccl.mesh_for("tp"), tensor_plan(planned.model, planned.lm_head, prefix="model.")
    )
    parallelize_context(planned, nccl.mesh_for("cp"), "torch_ring")
    ids = torch.randint(0, config.vocab_size, (2, 1024), device="cuda")
    labels = torch.roll(ids, -1, dims=1)

    plain_loss = causal_lm_loss(plain(ids), labels)
    plain_loss.backward()
    with maybe_loss_parallel(True):
        planned_loss = local_loss(causal_lm_loss(planned(ids), labels))
        planned_loss.backward()
    print(f"loss plain {plain_loss.item():.5f} planned {planned_loss.item():.5f}")
    assert abs(planned_loss.item() - plain_loss.item()) <= BF16_BAND * plain_loss.item()
    planned_grads = dict(planned.named_parameters())
    worst = 0.0
    for name, param in plain.named_parameters():
        grad = planned_grads[name].grad
        assert grad is not None, name
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        worst = max(worst, relative_error(full, param.grad))
    print(f"largest relative gradient error {worst:.2e}")
    assert worst <= BF16_BAND


def test_packed_rows_under_auto_context_attention_take_the_all_gather_path(nccl: ParallelDims) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cp_mesh = nccl.mesh_for("cp")
    split = LoadBalancedSplit(1, 0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1]], device="cuda")
    mask = document_causal_mask(document_ids(positions))
    q, k, v = (torch.randn(1, heads, 16, 64, device="cuda") for heads in (8, 4, 4))
    auto = context_attention(split, cp_mesh, "auto")
    assert isinstance(auto, TorchRingAttention) and isinstance(auto.packed, AllGatherAttention)
    torch.testing.assert_close(auto(q, k, v, mask), document_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"context_attention='torch_ring'.*'auto'.*'all_gather'"):
        context_attention(split, cp_mesh, "torch_ring")(q, k, v, mask)

    config = Qwen3Config.tiny(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        plain = Qwen3ForCausalLM(config)
    planned = copy.deepcopy(plain)
    parallelize_context(planned, cp_mesh, "auto")  # run_decoder gathers the positions over NCCL
    ids = torch.randint(0, config.vocab_size, positions.shape, device="cuda")
    torch.testing.assert_close(planned(ids, positions), plain(ids, positions), rtol=1e-5, atol=1e-5)
