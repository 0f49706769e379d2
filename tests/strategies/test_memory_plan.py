"""The memory plan (``plans/memory.py``, printed by the strategy at the first training step): its parameter and
optimizer numbers equal the bytes this rank actually holds after real optimizer steps (1 process, FSDP over 2),
within 5%; the activation estimate answers to the options it is given (its calibration against a measured CUDA
peak is tests/gpu/test_memory_plan_gpu.py); the fused LM head is counted by the tensors the fused loss really
holds, and the strategy counts it so exactly when ``model_loss`` fuses the head."""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy, ParallelDims, model_loss
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.pipeline import check_pipeline_config
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.memory import (
    ActivationShape,
    activation_bytes,
    optimizer_states_per_parameter,
    plan_memory,
)
from lightning_d9d.strategies.memory_report import PlannedRun, report_memory_plan

# the kernel's module (the package's attribute of that name is the function it exports)
lce = importlib.import_module("lightning_d9d.kernels.linear_cross_entropy")


class LM(L.LightningModule):
    """``fuse_head_loss`` is handed to the model (None: the default, the logits path on CPU); with
    ``plain_step`` the step runs its own forward and loss instead of ``model_loss``."""

    def __init__(self, fuse_head_loss: bool | None = None, plain_step: bool = False) -> None:
        super().__init__()
        self.config = Qwen3Config.tiny()
        self.model: Qwen3ForCausalLM | None = None
        self.fuse_head_loss, self.plain_step = fuse_head_loss, plain_step

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = Qwen3ForCausalLM(self.config)
            self.model.fuse_head_loss = self.fuse_head_loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        if self.plain_step:
            return causal_lm_loss(self.model(batch["input_ids"]), batch["labels"])
        return model_loss(self, self.model, (batch["input_ids"],), batch["labels"], causal_lm_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _fit(module: LM, *, rows: int, steps: int, run_id: str) -> L.Trainer:
    """``module`` fitted ``steps`` steps on ``rows`` rows of 32 random tokens, 4 a batch, on this world (CPU)."""
    world = int(os.environ["WORLD_SIZE"])
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID=run_id)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (rows, 33), generator=generator)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    trainer = L.Trainer(
        strategy=D9DStrategy(),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer


def _plan_and_measured_bytes() -> dict[str, float]:
    module = LM()
    trainer = _fit(module, rows=16, steps=2, run_id="memory-plan")
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
    assert plan.frozen == 120


def test_the_plan_shows_trained_and_frozen_parameters_apart() -> None:
    """LoRA's frozen base, or modules a user froze: the parameters line splits them from the trained ones."""
    trained = nn.Parameter(torch.zeros(2**20))
    frozen = nn.Parameter(torch.zeros(3 * 2**20), requires_grad=False)
    both = plan_memory([trained, frozen], optimizer_states=2, config=None, activations=None).describe("plan:")
    assert "parameters   16.00 MiB (4.00 MiB trained, 12.00 MiB frozen)" in both
    alone = plan_memory([trained], optimizer_states=2, config=None, activations=None).describe("plan:")
    assert "parameters   4.00 MiB\n" in alone and "frozen" not in alone


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


def _planned_run(dims: ParallelDims, options: ParallelOptions) -> PlannedRun:
    optimizer = torch.optim.AdamW(nn.Linear(256, 256).parameters())
    return PlannedRun(
        module=nn.Linear(256, 256),  # 257 KiB of float32 parameters
        optimizer=optimizer,
        device=torch.device("cpu"),
        dims=dims,
        pipeline=check_pipeline_config(dims.pp, "1F1B", None, None),
        precision="32-true",
        options=options,
    )


def test_the_report_warns_when_the_plan_exceeds_the_device() -> None:
    run = _planned_run(ParallelDims(dp_shard=2), ParallelOptions())
    with pytest.warns(UserWarning, match=r"more than the device's .* raise dp_shard / tp / pp") as caught:
        plan = report_memory_plan(run, batch=None, device_memory=2**20)
    assert plan is not None and plan.exceeds_device
    assert "reshard_after_forward" not in str(caught[0].message)  # sharded units free theirs already
    # kept on purpose where sharded: the one-rank hint ("with dp_shard=1") is not this case
    kept = _planned_run(ParallelDims(dp_shard=2), ParallelOptions(reshard_after_forward=False))
    with pytest.warns(UserWarning, match="more than the device's") as caught:
        report_memory_plan(kept, batch=None, device_memory=2**20)
    assert "reshard_after_forward" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report_memory_plan(run, batch=None, device_memory=2**30)


@pytest.mark.parametrize(
    ("options", "hinted"),
    [
        (ParallelOptions(), True),  # FSDP on the one rank keeps its gathered copy by default
        (ParallelOptions(reshard_after_forward=True), False),  # freed already
        (ParallelOptions(fsdp_on_one_rank=False), False),  # no FSDP: nothing to reshard
    ],
    ids=["default", "resharding", "no-fsdp"],
)
def test_the_warning_names_one_rank_resharding_where_it_would_free_memory(
    options: ParallelOptions, hinted: bool
) -> None:
    run = _planned_run(ParallelDims(dp_shard=1), options)
    with pytest.warns(UserWarning, match="more than the device's") as caught:
        report_memory_plan(run, batch=None, device_memory=2**20)
    assert ("reshard_after_forward=True" in str(caught[0].message)) == hinted


def test_the_fused_head_is_counted_by_what_it_keeps() -> None:
    config = Qwen3Config.qwen3_0_6b()
    hidden, vocab, tokens = 1024, 151936, 4096
    blocks = activation_bytes(config, ActivationShape(tokens=tokens, layers=28, head=False, dtype_bytes=2))
    logits = activation_bytes(config, ActivationShape(tokens=tokens, layers=28, dtype_bytes=2))
    fused = activation_bytes(
        config, ActivationShape(tokens=tokens, layers=28, dtype_bytes=2, head_fused=True)
    )
    assert blocks is not None and logits is not None and fused is not None
    # 4096 tokens cut into 2 chunks of 2048 (at most 2**28 + 2**26 logits a chunk: 2176 tokens at this vocab)
    chunk = 2048
    saved = vocab * hidden * 4 + tokens * hidden * 2  # grad_weight in float32, grad_hidden in bf16
    # forward: a chunk's bf16 logits, their float32 upcast and the bf16 gradient; backward: both gradients'
    # bf16 copies. The chunk is the larger here.
    assert chunk * vocab * (2 + 4 + 2) > (vocab * hidden + tokens * hidden) * 2
    assert fused - blocks == saved + chunk * vocab * (2 + 4 + 2)
    assert logits - blocks == tokens * vocab * 12  # the logits path is counted as before
    assert fused - blocks < (logits - blocks) / 2
    # a small vocabulary and a wide hidden size: the backward's copies outweigh one chunk (one of 128 tokens),
    # and in float32 a chunk is its logits alone (upcast and gradient are the logits themselves)
    wide = {"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 8192, "vocab_size": 1000}
    head = activation_bytes(wide, ActivationShape(tokens=128, layers=0, dtype_bytes=4, head_fused=True))
    assert head == 1000 * 4096 * 4 + 128 * 4096 * 4 + (1000 * 4096 + 128 * 4096) * 4
    assert activation_bytes(wide, ActivationShape(tokens=4096, layers=0, dtype_bytes=4, head_fused=True)) == (
        1000 * 4096 * 4 + 4096 * 4096 * 4 + max(4096 * 1000 * 4, (1000 * 4096 + 4096 * 4096) * 4)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_fused_head_estimate_bounds_what_the_fused_loss_holds(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU (the torch path): what the fused loss keeps from its forward to its backward (seen by the saved
    tensors hooks), plus the larger of its forward's chunk temporaries and its backward's outputs, is within
    the estimate, and the estimate within 5% of it (it counts these very tensors; the per-token float32
    vectors, a chunk's losses and log-sum-exp, are left out of both: 1/vocab of a chunk)."""
    monkeypatch.delenv(lce.ENV_VAR, raising=False)
    monkeypatch.setenv("LIGHTNING_D9D_KERNELS", "reference")
    hidden_size, vocab, tokens = 64, 1000, 512
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    chunk_bytes: list[int] = []
    chunk_loss_and_grad = lce._chunk_loss_and_grad

    def recorded(logits: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        losses, grad = chunk_loss_and_grad(logits, *args)
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (logits, grad)}
        # the chunk's float32 upcast (``logits.float()``: a copy below float32), alive while the gradient forms
        upcast = logits.numel() * 4 if logits.dtype != torch.float32 else 0
        chunk_bytes.append(sum(alive.values()) + upcast)
        return losses, grad

    monkeypatch.setattr(lce, "_chunk_loss_and_grad", recorded)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = lce.linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    reference = F.cross_entropy((hidden.detach().float() @ weight.detach().float().t()), labels)
    assert loss.item() == pytest.approx(reference.item(), rel=2e-2)  # the fused loss ran, not something else
    backward_outputs = sum(g.numel() * g.element_size() for g in (hidden.grad, weight.grad))
    held = sum(saved.values()) + max(max(chunk_bytes), backward_outputs)
    assert sum(saved.values()) >= vocab * hidden_size * 4  # grad_weight in float32 was among them

    config = {
        "hidden_size": hidden_size,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": vocab,
    }
    shape = ActivationShape(tokens=tokens, layers=0, dtype_bytes=hidden.element_size(), head_fused=True)
    estimate = activation_bytes(config, shape)
    assert estimate is not None
    print(f"{dtype}: held {held} bytes, estimate {estimate}")
    assert held <= estimate <= 1.05 * held
    unfused = activation_bytes(
        config, ActivationShape(tokens=tokens, layers=0, dtype_bytes=hidden.element_size())
    )
    assert unfused is not None and estimate < unfused


def _plan_activations(fuse_head_loss: bool | None, plain_step: bool) -> dict[str, float | None]:
    module = LM(fuse_head_loss=fuse_head_loss, plain_step=plain_step)
    trainer = _fit(module, rows=8, steps=1, run_id="memory-plan-head")
    plan = trainer.strategy.memory_plan  # type: ignore[attr-defined]
    shape = ActivationShape(tokens=4 * 32, layers=module.config.num_hidden_layers, dtype_bytes=4)
    return {
        "plan": plan.activations,
        "logits": activation_bytes(module.config, shape),
        "fused": activation_bytes(module.config, replace(shape, head_fused=True)),
    }


@pytest.mark.parametrize(
    ("fuse_head_loss", "plain_step", "head"),
    [(True, False, "fused"), (False, False, "logits"), (None, False, "logits"), (True, True, "logits")],
    ids=["fused", "fusion-off", "cpu-default", "step-without-model-loss"],
)
def test_the_trainer_plan_counts_the_head_as_model_loss_runs_it(
    fuse_head_loss: bool | None, plain_step: bool, head: str
) -> None:
    """The strategy's plan (1 process, float32, 4 rows of 32 tokens) counts the fused head where ``model_loss``
    fuses it, the logits where it does not (switched off, or on CPU by default), and the logits where the step
    runs its own forward and loss (reported after the step's forward, fused or not)."""
    (found,) = run_distributed(_plan_activations, 1, fuse_head_loss, plain_step, timeout=240)
    print(found)
    assert found["fused"] < found["logits"]
    assert found["plan"] == found[head]
