"""Packed rows on CUDA against the CPU-exact path (SDPA with the dense block-diagonal causal mask), fp32 and bf16:
SDPA with that mask on CUDA (rows that are not whole 128-blocks), FlexAttention on its block mask (rows of
whole blocks: ``auto``'s choice on CUDA), eager and compiled per block; on two GPUs a Fabric loop at cp=2
(``context_attention="auto"``: torch's ring kernels, packed batches on the all-gather path over NCCL) against
one GPU's plain loop, fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fabric"))
from fabric_loop import BASE
from test_fabric_gpu import assert_fabric_run_matches_a_plain_loop
from test_packed_documents import build, documents, packed_batch

from lightning_d9d.data import pack_documents
from lightning_d9d.modules.attention import document_attention_path
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import apply_compile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def train_step_on_cpu_then_cuda(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, path: str
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """One forward and backward of ``batch`` on CPU (the dense mask), then on CUDA, where ``auto`` takes
    ``path``: the same loss (1e-5) and gradients (1e-4) in fp32 (reductions in another order only). Returns the
    CUDA loss, inputs and labels; the model stays on CUDA with its CUDA gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    inputs = (batch["input_ids"], batch["position_ids"])
    cpu_loss = causal_lm_loss(model(*inputs), batch["labels"])
    cpu_loss.backward()
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.cuda()
    cuda_inputs = tuple(t.cuda() for t in inputs)
    labels = batch["labels"].cuda()
    assert document_attention_path(cuda_inputs[1]) == path
    loss = causal_lm_loss(model(*cuda_inputs), labels)
    loss.backward()
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-5, atol=1e-5)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad.cpu(), grad, rtol=1e-4, atol=1e-5, msg=name)
    return loss, cuda_inputs, labels


@pytest.mark.parametrize("kind", ["qwen3", "moe"])
def test_packed_rows_on_cuda_match_the_cpu_path(kind: str) -> None:
    model = build(kind)
    fp32_loss, cuda_inputs, labels = train_step_on_cpu_then_cuda(
        model, packed_batch(documents(model.config.vocab_size)), path="sdpa"
    )
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = causal_lm_loss(model(*cuda_inputs), labels)
    # measured on an H200: 3.2e-5 (Qwen3) and 2.1e-5 (Qwen3-MoE) relative to the fp32 CPU loss; a
    # bf16 loss over ~60 tokens averages its per-token rounding (2^-8 each): the band is 30x the measurement
    reference = float(fp32_loss.detach())  # CUDA fp32, equal to the CPU loss at 1e-5
    relative = abs(float(bf16) - reference) / reference
    print(f"packed {kind}: bf16 loss {float(bf16):.5f} vs fp32 {reference:.5f} ({relative:.1e} relative)")
    assert relative < 1e-3


def _rows_of(length: int, rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``rows`` packed rows of ``length`` tokens from documents of 2 to 150 tokens (some rows of one block hold
    a single document: FlexAttention's unmasked tiles run too)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 150, (4 * rows * length // 75,), generator=generator).tolist()
    lengths[:3] = [length + 1, 2, 2 * length]  # whole rows of one document, and a document cut over two rows
    docs = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    return torch.utils.data.default_collate(list(pack_documents(docs, length))[:rows])


def test_flex_attention_on_cuda_matches_the_cpu_path_in_training_and_compiles_once() -> None:
    model = build("qwen3")
    batch = _rows_of(256, 4, model.config.vocab_size, seed=5)
    loss, cuda_inputs, labels = train_step_on_cpu_then_cuda(model, batch, path="flex")
    model.zero_grad()

    # compiled blocks trace FlexAttention into their graph; a new batch's mask (same shapes) must not recompile
    apply_compile(model.model.layers)
    eager = [float(loss.detach())]
    compiled = [float(causal_lm_loss(model(*cuda_inputs), labels))]
    torch._dynamo.config.error_on_recompile = True
    try:
        for seed in (6, 7):
            other = {k: v.cuda() for k, v in _rows_of(256, 4, model.config.vocab_size, seed).items()}
            compiled.append(
                float(causal_lm_loss(model(other["input_ids"], other["position_ids"]), other["labels"]))
            )
    finally:
        torch._dynamo.config.error_on_recompile = False
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = float(causal_lm_loss(model(*cuda_inputs), labels))
    relative = abs(bf16 - eager[0]) / eager[0]
    print(f"flex: fp32 {eager[0]:.5f}, compiled {compiled[0]:.5f}, bf16 {bf16:.5f} ({relative:.1e} relative)")
    assert relative < 1e-3  # as the dense path's band above: ~1e3 tokens average their bf16 rounding


def test_a_transformers_model_takes_flex_attention_on_cuda_as_transformers_own_packed_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter's documents' attention on CUDA (FlexAttention on rows of whole blocks) against ``transformers``'
    own packed path (its dense mask; ``LIGHTNING_D9D_HF_DOCUMENT_ATTENTION=0``), fp32: the same loss (1e-5) and
    gradients (1e-4); its decoder layers compiled, a new batch's mask compiles nothing again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
    from tiny_hf import tiny_causal_lm

    from lightning_d9d.models.hf.attention import (
        DOCUMENTS_ATTENTION_NAME,
        DOCUMENTS_ENV_VAR,
        causal_attention_without_mask_sync,
    )

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_causal_lm("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16).cuda()
    assert causal_attention_without_mask_sync(model)
    batch = {k: v.cuda() for k, v in _rows_of(256, 4, model.config.vocab_size, seed=5).items()}

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        loss = causal_lm_loss(logits, batch["labels"])
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}

    monkeypatch.setenv(DOCUMENTS_ENV_VAR, "0")
    theirs, their_grads = step()
    monkeypatch.delenv(DOCUMENTS_ENV_VAR)
    assert document_attention_path(batch["position_ids"]) == "flex"
    ours, our_grads = step()
    assert model.config._attn_implementation == DOCUMENTS_ATTENTION_NAME
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    apply_compile(model.model.layers)
    step()
    torch._dynamo.config.error_on_recompile = True
    try:
        batch = {k: v.cuda() for k, v in _rows_of(256, 4, model.config.vocab_size, seed=6).items()}
        step()
    finally:
        torch._dynamo.config.error_on_recompile = False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_packed_rows_at_cp2_on_two_gpus_match_one_gpu(tmp_path: Path) -> None:
    # context_attention="auto": torch's ring kernels, which hand packed rows to the all-gather path
    config = {**BASE, "devices": 2, "accelerator": "cuda", "dims": {"cp": 2}, "packed": True}
    assert_fabric_run_matches_a_plain_loop(config, tmp_path, "cp2 packed on 2 GPUs")
