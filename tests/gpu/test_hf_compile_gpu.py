"""Tiny ``transformers`` Gemma 3 and GPT-OSS on one CUDA GPU under the adapter's plan, trained with their decoder
layers compiled by Inductor (``D9DStrategy(compile=True)``) against the same plan run eagerly: the same losses and
parameters within the bands below. Gemma 3: scaled embeddings, q/k norms, sliding and full layers. GPT-OSS:
attention sinks, biased projections, sliding and full layers, its biased router and its experts in their own
layout (``models/hf/expert_layouts.py``: per-expert biases, gate and up interleaved, the clamped SwiGLU, which
bites on these weights), run by the adapter's grouped-GEMM forward. Sequences of 64 tokens, windows of 16.

fp32, ``STEPS`` AdamW steps (``tiny_hf.optimizer_for``: lr 1e-3, eps 1e-4), the same batches, one process (no
launcher). Bands:

- ``FIRST_LOSS_BAND`` (1e-5): before any step both runs hold the same weights, and Inductor's kernels differ from
  eager's only in fusion and in the order of fp32 reductions, a few ulps per op (~1e-7 of a loss near
  ``ln(vocab)`` = 4.85). A traced graph that lost a step of the math (a sink, the window's band, the clamp) is
  off by far more: broken variants moved the losses of the CPU tests' tiny GPT-OSS by 3e-3 to 1e-2 (an
  attention bias added twice, sinks misplaced or dropped: ``tests/models/hf/test_hf_tensor_parallel.py``).
- ``LOSS_BAND`` / ``PARAM_BAND`` (1e-4): later steps start from parameters that differ by those roundings, and
  Adam normalises each gradient entry (a step moves an entry by up to lr, 1e-3, whatever its gradient), so the
  runs drift apart by up to ~1e-5 a step; ten steps stay within 1e-4, an order below one step's move.

Run on a CUDA GPU: ``pytest -m gpu tests/gpu/test_hf_compile_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS, ROWS, SEQ = 10, 4, 64
FIRST_LOSS_BAND, LOSS_BAND, PARAM_BAND = 1e-5, 1e-4, 1e-4
# config overrides of tiny_hf's families: windows shorter than the sequence on the sliding layers
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {"sliding_window": 16},
}


def train(family: str, compile: bool, accelerator: str = "gpu") -> dict[str, Any]:
    """``STEPS`` steps of the tiny ``family`` under ``D9DStrategy(compile=compile)``: per step the loss, at the
    end the parameters (whole), how many decoder layers were compiled and dynamo's graph breaks."""
    import lightning as L
    from tiny_hf import VOCAB, batch, optimizer_for, tiny_causal_lm
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_d9d import D9DStrategy, model_loss
    from lightning_d9d.modules.loss import causal_lm_loss

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_causal_lm(family, **FAMILIES[family])  # seeded: the same weights in both runs
            self.losses: list[torch.Tensor] = []

        def training_step(self, data: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids, labels = data
            loss = model_loss(self, self.model, {"input_ids": ids}, labels, causal_lm_loss)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(self.parameters())

    torch._dynamo.reset()
    counters.clear()
    rows = [
        (ids, labels)
        for step in range(STEPS)
        for ids, labels in zip(*batch(step, seq=SEQ, vocab=VOCAB), strict=True)
    ]
    module = TinyLM()
    trainer = L.Trainer(
        strategy=D9DStrategy(compile=compile),
        accelerator=accelerator,
        devices=1,
        precision="32-true",
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(rows, batch_size=ROWS))
    return {
        "losses": [float(loss) for loss in module.losses],
        "params": {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in module.model.named_parameters()
        },
        "compiled_layers": sum(
            getattr(m, "_compiled_call_impl", None) is not None for m in module.model.modules()
        ),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_layers_train_as_eager(family: str) -> None:
    eager, compiled = train(family, compile=False), train(family, compile=True)
    assert eager["compiled_layers"] == 0 and compiled["compiled_layers"] == 2  # per decoder layer
    differences = [abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True)]
    worst_param = max(
        float((compiled["params"][name] - param).abs().max()) for name, param in eager["params"].items()
    )
    print(
        f"{family}: first loss {eager['losses'][0]:.6f}, largest loss difference {max(differences):.3g}, "
        f"largest parameter difference {worst_param:.3g}, graph breaks {compiled['graph_breaks']}"
    )
    assert len(differences) == STEPS
    assert differences[0] <= FIRST_LOSS_BAND
    assert max(differences) <= LOSS_BAND
    assert worst_param <= PARAM_BAND
    assert compiled["losses"][-1] < compiled["losses"][0]  # it trained
