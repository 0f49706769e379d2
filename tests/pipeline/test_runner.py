"""The pipeline runner on gloo ranks: gradient accumulation without reduce-scatter on every micro-step, and the
check that every pipeline rank holds the same batch."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from torch.distributed.tensor import DTensor

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.pipeline import PipelineRunner, StageLayout, carve_stages, check_pipeline_config
from lightning_d9d.plans import ParallelOptions, parallelize_default


def _runner(pp: int, dp_shard: int, default_plan: bool = False) -> tuple[PipelineRunner, Qwen3ForCausalLM]:
    dims = ParallelDims(pp=pp, dp_shard=dp_shard).resolve(pp * dp_shard).build_mesh("cpu")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.tiny(num_hidden_layers=2))
    config = check_pipeline_config(pp, "1F1B", 2, None)
    stages = carve_stages(model, config, dims, StageLayout())
    for stage in stages.values():
        if default_plan:  # as for a user's splittable model whose stages bring no plan
            parallelize_default(stage, dims, ParallelOptions(), pipeline_stage=True)
        else:
            stage.parallelize(dims, ParallelOptions())  # type: ignore[operator]
    return PipelineRunner(config, model, stages, dims, torch.device("cpu")), model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
    }


def _accumulate_two_batches(hold_back_first: bool) -> tuple[bool, dict[str, torch.Tensor]]:
    runner, model = _runner(pp=2, dp_shard=2)
    rank = torch.distributed.get_rank()
    first_done_without_grads = True
    for step in range(2):
        inputs, target = _batch(seed=10 * step + rank % 2)  # dp peers differ, pp peers agree
        runner.sync_gradients = not (hold_back_first and step == 0)
        runner.train_step((inputs,), target, causal_lm_loss, accumulate=2)
        if step == 0:
            first_done_without_grads = all(p.grad is None for p in model.parameters())
    grads = _grads(model)
    assert all(g is not None for g in grads.values())
    return first_done_without_grads, grads  # type: ignore[return-value]


def _compare_accumulation() -> tuple[bool, float]:
    held_back, grads = _accumulate_two_batches(hold_back_first=True)
    _, every_step = _accumulate_two_batches(hold_back_first=False)
    worst = max((grads[name] - every_step[name]).abs().max().item() for name in grads)
    return held_back, worst


def test_accumulation_reduces_gradients_once() -> None:
    """pp=2 x dp_shard=2: a micro-step that does not sync leaves no sharded gradient behind (nothing was
    reduce-scattered), and the synced sum equals reducing on every micro-step."""
    for held_back, worst in run_distributed(_compare_accumulation, 4):
        assert held_back, "gradients were reduce-scattered on an accumulation micro-step"
        assert worst < 1e-6


def _mismatched_batches() -> str:
    runner, _ = _runner(pp=2, dp_shard=1)
    inputs, target = _batch(seed=torch.distributed.get_rank())  # sharded by global rank: wrong under pp
    with pytest.raises(ValueError, match="pipeline ranks got different batches") as raised:
        runner.train_step((inputs,), target, causal_lm_loss, accumulate=1)
    return str(raised.value)


def test_pipeline_ranks_with_different_batches_are_refused() -> None:
    messages = run_distributed(_mismatched_batches, 2)
    assert all("distributed_sampler_kwargs" in message for message in messages)


def _same_batches_pass_the_check() -> float:
    runner, _ = _runner(pp=2, dp_shard=1, default_plan=True)
    inputs, target = _batch(seed=3)
    return float(runner.train_step((inputs,), target, causal_lm_loss, accumulate=1))


def test_pipeline_ranks_with_the_same_batch_train() -> None:
    losses = run_distributed(_same_batches_pass_the_check, 2)
    assert losses[0] == losses[1] > 0
