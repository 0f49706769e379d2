"""Distributed norm clipping across meshes, and no gradient communication on accumulation micro-steps."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_d9d import D9DStrategy
from lightning_d9d.strategies.grad_norm import clip_grad_norm_


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _clip_with_parameters_on_two_meshes(max_norm: float) -> tuple[float, float, float]:
    reference = _model()
    model = copy.deepcopy(reference)
    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=flat)
    fully_shard(model[2], mesh=grid)  # HSDP: another mesh than the first layer
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    for net in (model, reference):
        net(x).pow(2).mean().backward()
    norm = clip_grad_norm_(model.parameters(), max_norm)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    grad_error = max(
        (_full(p.grad) - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return norm.item(), expected_norm.item(), grad_error


def test_clip_grad_norm_on_two_meshes_matches_torch_on_one_process() -> None:
    for norm, expected_norm, grad_error in run_distributed(_clip_with_parameters_on_two_meshes, 4, 0.01):
        assert expected_norm > 0.01  # the threshold bites
        assert abs(norm - expected_norm) < 1e-6
        assert grad_error < 1e-7


def _accumulate_without_sync() -> tuple[bool, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    strategy = D9DStrategy()
    strategy.model = model
    batches = [torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    with strategy.block_backward_sync():
        model(batches[rank][0]).pow(2).mean().backward()
    nothing_reduced = all(p.grad is None for p in model.parameters())
    model(batches[rank][1]).pow(2).mean().backward()
    # single process: the mean over ranks of the sum over micro-steps
    sum(reference(b[i]).pow(2).mean() for b in batches for i in range(2)).div(world).backward()
    error = max(
        (_full(p.grad) - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return nothing_reduced, error


def test_block_backward_sync_defers_the_reduction_to_the_last_micro_step() -> None:
    for nothing_reduced, error in run_distributed(_accumulate_without_sync, 2):
        assert nothing_reduced, "gradients were reduce-scattered on a non-final micro-step"
        assert error < 1e-6


def _clip_with_a_frozen_pipeline_rank() -> float:
    """Rank 1 plays a pipeline stage whose parameters are all frozen: it has no gradients at all."""
    model = _model()
    if dist.get_rank() == 0:
        model(torch.ones(3, 8)).sum().backward()
    norm = clip_grad_norm_(model.parameters(), 1e9, extra_groups=[dist.group.WORLD])
    return norm.item()


def test_norm_clipping_with_a_rank_without_gradients_does_not_hang() -> None:
    norms = run_distributed(_clip_with_a_frozen_pipeline_rank, 2, timeout=60)
    model = _model()
    model(torch.ones(3, 8)).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert norms[0] == norms[1]
    assert abs(norms[0] - expected) < 1e-5


def _sum_logged_under_pipelining() -> tuple[float, float]:
    import torchmetrics

    from lightning_d9d.mesh import ParallelDims
    from lightning_d9d.strategies.data_ranks import sync_metrics_over_data_ranks

    strategy = D9DStrategy(pp=2, dp_shard=1)
    strategy._dims = ParallelDims(pp=2, dp_shard=1).resolve(2).build_mesh("cpu")
    logged = strategy.reduce(torch.tensor(1.0), reduce_op="sum")
    holder = nn.Module()
    holder.metric = torchmetrics.SumMetric()
    sync_metrics_over_data_ranks(holder, strategy.parallel_dims)
    holder.metric.update(torch.tensor(1.0))
    return float(logged), float(holder.metric.compute())


def test_logged_sums_and_metrics_count_each_batch_once_under_pipelining() -> None:
    """pp=2 on 2 ranks: both ranks hold the same batch (dp = 1), so a sum over the data must not double."""
    for logged, metric in run_distributed(_sum_logged_under_pipelining, 2):
        assert logged == 1.0
        assert metric == 1.0
