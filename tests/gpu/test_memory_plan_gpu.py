"""The memory plan's activation estimate against the measured CUDA peak of one training step: a Qwen3-0.6B-shaped
model (28 layers, hidden 1024, vocabulary 151936) in bf16 on one GPU, 4 x 2048 tokens, with and without
activation checkpointing. Run on a CUDA GPU: ``pytest -m gpu tests/gpu/test_memory_plan_gpu.py -s``.

Measured: the step's peak of allocated memory minus what was allocated before its forward (parameters, gradients
kept allocated by ``zero_grad(set_to_none=False)``, optimizer state), i.e. what forward and backward add at
their worst. The estimate (``activation_bytes``) must be within 25% of it; both print, with their ratio.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.plans.checkpointing import apply_activation_checkpointing
from lightning_d9d.plans.memory import ActivationShape, activation_bytes

pytestmark = pytest.mark.gpu

BATCH, SEQ = 4, 2048


def _step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    del logits  # as in the strategy's model_loss: only the loss outlives the forward
    loss.backward()


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
def test_activation_estimate_within_25_percent_of_the_cuda_peak(recompute: bool) -> None:
    torch.manual_seed(0)
    config = Qwen3Config.qwen3_0_6b(tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
    if recompute:
        apply_activation_checkpointing(model.model.layers, preserve_rng_state=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), device="cuda")
    _step(model, ids)  # warm-up: gradients, optimizer state, kernels' workspaces exist from here on
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(model, ids)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    shape = ActivationShape(tokens=BATCH * SEQ, layers=config.num_hidden_layers, recompute=recompute)
    estimate = activation_bytes(config, shape)
    assert estimate is not None
    print(
        f"\nactivations ({'recompute' if recompute else 'no recompute'}): estimate {estimate / 2**30:.2f} GiB, "
        f"measured peak above the resting state {measured / 2**30:.2f} GiB, ratio {estimate / measured:.2f} "
        f"({torch.cuda.get_device_name()}, torch {torch.__version__})"
    )
    assert abs(estimate - measured) <= 0.25 * measured
