"""``D9DStrategy(compile="reduce-overhead", fsdp_on_one_rank=False)`` on one CUDA GPU: the blocks really run as
CUDA graphs (cudagraph trees recorded graphs, Inductor skipped none) and train as ``compile=True`` does.

The tiny Qwen3 in fp32, and the tiny Qwen3-MoE in bf16-mixed (its experts on torch's grouped GEMM, selection
biases moved after every step from the loads the graphs counted), 20 steps each, in this process (one device: no
launcher); the MoE in fp32 too, where the grouped GEMM is the host-reading loop, which Inductor must keep out of
the recorded graphs. Run on a CUDA GPU: ``pytest -m gpu tests/gpu/test_cudagraphs_gpu.py``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 20
# "reduce-overhead" is the default mode's options plus triton.cudagraphs (torch._inductor.list_mode_options): the
# same graphs, the same Inductor kernels, replayed. What may still differ between two runs is the order of
# atomic additions of kernels that use them (SDPA's and the embedding's backward), in either mode alike, a few
# fp32 ulps per step (~1e-7 of a loss near ln(vocab)); 1e-5 over 20 steps allows their growth and is two orders
# below what an error in a graph's inputs or outputs does (a step replayed on stale activations or gradients).
# The test prints whether the losses are bitwise equal.
TOLERANCE = 1e-5


def fresh_compile_state() -> None:
    """No graphs or counters of an earlier run in this process (cudagraph trees are reset with dynamo)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def one_gpu_trainer(compile: bool | str, precision: str, callbacks: list[Any] | None = None) -> Any:
    """A quiet ``Trainer`` on one GPU without FSDP on the one rank (what CUDA graphs need), ``STEPS`` steps."""
    import lightning as L

    from lightning_d9d import D9DStrategy

    return L.Trainer(
        strategy=D9DStrategy(compile=compile, fsdp_on_one_rank=False),
        accelerator="gpu",
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )


def graph_facts() -> dict[str, int]:
    """Graphs recorded since :func:`fresh_compile_state` (roots holds recorded CUDAGraphNodes only: warm-up runs
    are not recordings) and Inductor's count of graphs it ran without CUDA graphs."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return {
        "recorded_roots": 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def train(compile: bool | str, *, moe: bool = False, precision: str = "32-true") -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus
    from torch.utils.data import DataLoader

    from lightning_d9d.callbacks.moe import ExpertLoadBalancing
    from lightning_d9d.models import Qwen3Config, Qwen3MoeConfig
    from lightning_d9d.modules.moe import TopKRouter

    class RecordLosses(Callback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            self.losses.append(outputs["loss"].detach().clone())  # no host sync each step

    fresh_compile_state()
    L.seed_everything(0, verbose=False)
    config = Qwen3MoeConfig.tiny(router_selection_bias=True) if moe else Qwen3Config.tiny()
    recorder = RecordLosses()
    callbacks: list[Callback] = [recorder, ExpertLoadBalancing(log_load=False)] if moe else [recorder]
    trainer = one_gpu_trainer(compile, precision, callbacks)
    module = Qwen3Pretraining(config, lr=3e-3, warmup_steps=2, max_steps=STEPS)
    data = SyntheticCorpus(config.vocab_size, 64, 4 * STEPS)
    trainer.fit(module, DataLoader(data, batch_size=4))
    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    return {
        "losses": [float(loss) for loss in recorder.losses],
        # moved every step from the loads counted in the (replayed) forward: a count lost or doubled moves them
        "biases": [router.expert_bias.detach().cpu() for router in routers if router.expert_bias is not None],
        **graph_facts(),
    }


def test_reduce_overhead_records_cuda_graphs_and_trains_as_default_compile(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_d9d.plans"):
        graphs = train("reduce-overhead")
    assert not [r for r in caplog.records if r.name == "lightning_d9d.plans"], "the plan fell back"
    assert graphs["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (its log says why)"
    assert graphs["recorded_roots"] > 0, "no CUDA graph was recorded"
    default = train(True)
    assert default["recorded_roots"] == 0  # the default mode records none: the signal tells the modes apart
    assert len(graphs["losses"]) == len(default["losses"]) == STEPS
    worst = max(abs(a - b) for a, b in zip(graphs["losses"], default["losses"], strict=True))
    print(f"reduce-overhead vs default: largest loss difference {worst:.3g} (bitwise: {worst == 0})")
    assert worst <= TOLERANCE, (graphs["losses"], default["losses"])
    assert (
        graphs["losses"][-1] < graphs["losses"][0] - 0.1
    )  # it learnt: the comparison is not of two flat runs


# The MoE in bf16-mixed: the same kernels in both modes again (losses and biases come out bitwise equal on an
# H100); TOLERANCE allows the atomics above. A selection bias moves by the callback's rate (1e-3) a
# step, so one rate is one step on which a single expert's load compared differently with the mean.
BIAS_TOLERANCE = 1e-3


def test_moe_blocks_record_cuda_graphs_and_train_as_default_compile(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_d9d.plans"):
        graphs = train("reduce-overhead", moe=True, precision="bf16-mixed")
    assert not [r for r in caplog.records if r.name == "lightning_d9d.plans"], "the plan fell back"
    assert graphs["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (its log says why)"
    assert graphs["recorded_roots"] > 0, "no CUDA graph was recorded"
    default = train(True, moe=True, precision="bf16-mixed")
    assert len(graphs["losses"]) == len(default["losses"]) == STEPS
    worst = max(abs(a - b) for a, b in zip(graphs["losses"], default["losses"], strict=True))
    bias_gap = max(
        float((a - b).abs().max()) for a, b in zip(graphs["biases"], default["biases"], strict=True)
    )
    print(
        f"MoE reduce-overhead vs default: loss difference {worst:.3g}, selection-bias difference {bias_gap:.3g}"
    )
    assert worst <= TOLERANCE, (graphs["losses"], default["losses"])
    assert bias_gap <= BIAS_TOLERANCE, (graphs["biases"], default["biases"])
    # loads not counted under the graphs would leave every bias at 0
    assert graphs["biases"] and all(float(b.abs().max()) > 0 for b in graphs["biases"])
    assert graphs["losses"][-1] < graphs["losses"][0] - 0.1


def test_moe_blocks_on_the_host_reading_grouped_gemm_keep_it_out_of_the_cuda_graphs() -> None:
    """fp32: ``auto`` picks the ``loop`` grouped GEMM, which reads the group sizes on the host; its operators carry
    the cudagraph_unsafe tag, so Inductor records the graph's other parts (graph partitions, on by default) and
    runs the loop between them: a capture of the host read would fail. It trains as the default mode."""
    graphs = train("reduce-overhead", moe=True)
    assert graphs["recorded_roots"] > 0, "no CUDA graph was recorded"
    default = train(True, moe=True)
    worst = max(abs(a - b) for a, b in zip(graphs["losses"], default["losses"], strict=True))
    print(f"MoE fp32 reduce-overhead (loop GEMM, skips {graphs['cudagraph_skips']}) vs default: {worst:.3g}")
    assert worst <= TOLERANCE, (graphs["losses"], default["losses"])


def train_hf_moe(compile: bool | str) -> dict[str, Any]:
    """A LightningModule around a tiny ``transformers`` Qwen3-MoE (the adapter's plan), bf16-mixed, one GPU
    without FSDP: its experts run the adapter's forward (torch's grouped GEMM in bf16 over the fp32 weights), not
    ``transformers``' fallback loop, which reads the group offsets on the host."""
    import lightning as L
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
    from tiny_hf import VOCAB, tiny_model

    from lightning_d9d import model_loss
    from lightning_d9d.models.hf.config_plans import expert_modules
    from lightning_d9d.modules.loss import causal_lm_loss

    class HFMoe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = tiny_model("qwen3_moe")
            self.losses: list[torch.Tensor] = []

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            # causal_lm_loss takes a transformers output (on CUDA: the head fused with the loss)
            loss = model_loss(self, self.model, (ids,), ids, causal_lm_loss)
            self.losses.append(loss.detach().clone())  # no host sync each step
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    fresh_compile_state()
    L.seed_everything(0, verbose=False)
    module = HFMoe()
    ids = torch.randint(0, VOCAB, (4 * STEPS, 32), generator=torch.Generator().manual_seed(3))
    one_gpu_trainer(compile, "bf16-mixed").fit(module, DataLoader(ids, batch_size=4))
    return {
        "losses": [float(loss) for loss in module.losses],
        "ours": ["forward" in vars(experts) for experts in expert_modules(module.model).values()],
        **graph_facts(),
    }


def test_a_transformers_moe_model_records_cuda_graphs_and_trains_as_default_compile(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_d9d.plans"):
        graphs = train_hf_moe("reduce-overhead")
    assert not [r for r in caplog.records if r.name == "lightning_d9d.plans"], "the plan fell back"
    assert graphs["ours"] == [True, True], "the experts kept transformers' forward"
    assert graphs["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (its log says why)"
    assert graphs["recorded_roots"] > 0, "no CUDA graph was recorded"
    default = train_hf_moe(True)
    assert len(graphs["losses"]) == len(default["losses"]) == STEPS
    worst = max(abs(a - b) for a, b in zip(graphs["losses"], default["losses"], strict=True))
    print(f"transformers MoE reduce-overhead vs default: largest loss difference {worst:.3g}")
    assert worst <= TOLERANCE, (graphs["losses"], default["losses"])
    assert graphs["losses"][-1] < graphs["losses"][0] - 0.1
