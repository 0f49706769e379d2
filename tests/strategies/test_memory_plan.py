"""The memory plan (``plans/memory.py``, printed by the strategy at the first batch): its parameter and optimizer
numbers equal the bytes this rank actually holds after real optimizer steps (1 process, FSDP over 2), within 5%;
the activation estimate answers to the options it is given (its calibration against a measured CUDA peak is
tests/gpu/test_memory_plan_gpu.py)."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy, ParallelDims, model_loss
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans.memory import (
    ActivationShape,
    activation_bytes,
    optimizer_states_per_parameter,
    plan_memory,
)
from lightning_d9d.strategies.memory_report import report_memory_plan


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.config = Qwen3Config.tiny()
        self.model: Qwen3ForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = Qwen3ForCausalLM(self.config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return model_loss(self, self.model, (batch["input_ids"],), batch["labels"], causal_lm_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _plan_and_measured_bytes() -> dict[str, float]:
    world = int(os.environ["WORLD_SIZE"])
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="memory-plan")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (16, 33), generator=generator)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    trainer = L.Trainer(
        strategy=D9DStrategy(),
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LM()
    trainer.fit(module, DataLoader(data, batch_size=4))  # type: ignore[arg-type]
    plan = trainer.strategy.memory_plan  # type: ignore[attr-defined]
    optimizer = trainer.optimizers[0]
    states = [
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()
    ]
    return {
        "plan_parameters": plan.parameters,
        "plan_optimizer": plan.optimizer,
        "plan_gradients": plan.gradients,
        "parameters": sum(_local_bytes(p) for p in module.parameters()),
        "gradients": sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for v in states),
        "activations": plan.activations,
    }


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "fsdp2"])
def test_plan_equals_the_bytes_held_after_optimizer_steps(world: int) -> None:
    for rank, found in enumerate(run_distributed(_plan_and_measured_bytes, world, timeout=240)):
        print(f"world {world} rank {rank}: {found}")
        assert found["optimizer"] > 0 and found["parameters"] > 0
        for kind in ("parameters", "optimizer"):
            assert abs(found[f"plan_{kind}"] - found[kind]) <= 0.05 * found[kind], (kind, found)
        assert found["activations"] > 0
    full = sum(p.numel() * 4 for p in Qwen3ForCausalLM(Qwen3Config.tiny()).parameters())
    assert found["parameters"] * world == pytest.approx(full, rel=0.05)  # sharded, not replicated


def test_optimizer_states_per_parameter() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_states_per_parameter(torch.optim.AdamW(params)) == 2
    assert optimizer_states_per_parameter(torch.optim.Adam(params, amsgrad=True)) == 3
    assert optimizer_states_per_parameter(torch.optim.SGD(params, lr=0.1)) == 0
    assert optimizer_states_per_parameter(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 1
    assert optimizer_states_per_parameter(torch.optim.LBFGS(params)) is None


def test_frozen_parameters_have_no_gradient_or_state() -> None:
    trained, frozen = nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(30), requires_grad=False)
    plan = plan_memory([trained, frozen], optimizer_states=2, config=None, activations=None)
    assert (plan.parameters, plan.gradients, plan.optimizer, plan.activations) == (160, 40, 80, None)


def test_activation_estimate_answers_to_its_options() -> None:
    config = Qwen3Config.qwen3_0_6b()
    base = ActivationShape(tokens=4096, layers=28, head=False)
    full = activation_bytes(config, base)
    assert full is not None
    # hand count per token and layer: 4h + 4 q + 3 kv widths + 3 intermediate, 2 bytes each
    assert full == 4096 * 28 * (4 * 1024 + 4 * 16 * 128 + 3 * 8 * 128 + 3 * 3072) * 2
    assert activation_bytes(config, ActivationShape(tokens=4096, layers=28, head=False, tp=2)) == full // 2
    recomputed = activation_bytes(config, ActivationShape(tokens=4096, layers=28, head=False, recompute=True))
    assert recomputed is not None and recomputed < full / 5
    with_head = activation_bytes(config, ActivationShape(tokens=4096, layers=28))
    assert with_head == full + 4096 * 151936 * 12
    assert activation_bytes({"vocab_size": 10}, base) is None  # no sizes: unknown, not a guess


def test_a_plan_over_the_device_memory_says_so() -> None:
    plan = plan_memory([nn.Parameter(torch.zeros(2**20))], optimizer_states=2, config=None, activations=None)
    assert plan.total == 16 * 2**20 and not plan.exceeds_device  # 4 MiB each: parameters, gradients, 2 states
    small, large = replace(plan, device_memory=15 * 2**20), replace(plan, device_memory=17 * 2**20)
    assert small.exceeds_device and not large.exceeds_device
    text = small.describe("plan:")
    assert "total        16.00 MiB of 15.00 MiB on the device" in text and "activations  unknown" in text


def test_the_report_warns_when_the_plan_exceeds_the_device() -> None:
    optimizer = torch.optim.AdamW(nn.Linear(256, 256).parameters())
    strategy = SimpleNamespace(
        lightning_module=nn.Linear(256, 256),  # 257 KiB of float32 parameters
        optimizers=[optimizer],
        root_device=torch.device("cpu"),
        parallel_dims=ParallelDims(dp_shard=1),
        precision_plugin=SimpleNamespace(precision="32-true"),
        parallel_options=lambda: SimpleNamespace(activation_checkpointing=False),
    )
    with pytest.warns(UserWarning, match=r"more than the device's .* raise dp_shard / tp / pp"):
        plan = report_memory_plan(strategy, batch=None, device_memory=2**20)  # type: ignore[arg-type]
    assert plan is not None and plan.exceeds_device
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report_memory_plan(strategy, batch=None, device_memory=2**30)  # type: ignore[arg-type]
