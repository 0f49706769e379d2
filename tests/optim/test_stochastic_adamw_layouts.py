"""``StochasticAdamW`` on sharded parameters (2 gloo ranks, one launch): under FSDP2 (``fully_shard``, rows split
unevenly where 2 does not divide them) and a tensor-parallel column split, 6 steps (the shards 5 elements at a
time) give the parameters and every state tensor of one process bit for bit, in each of the optimizer's options.

Each rank gets the gradients one process gets (the same global tensors, split as the parameter is): the random
bits are a hash of the global element index, so equal values round equally wherever they live. A run whose ranks
compute their own gradients matches only as far as FSDP's reduce-scatter sums in one process's order, which it
does not in general: that parity is the strategies' parity tests' (within their tolerances), not the optimizer's.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_d9d.optim import StochasticAdamW
from lightning_d9d.optim.stochastic_rounding import axis_offsets, flat_global_index, global_element_index
from lightning_d9d.plans.memory import optimizer_states_per_parameter, plan_memory

OPTIONS: list[dict[str, Any]] = [
    {},
    {"moments_dtype": torch.float32},
    {"master_weights": True},
    {"master_weights": True, "moments_dtype": torch.float32},
]
STEPS = 6


def model_and_column() -> tuple[nn.Module, nn.Parameter]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 6), nn.Linear(6, 5)).to(torch.bfloat16)
    column = nn.Parameter(torch.randn(6, 10).to(torch.bfloat16))
    return model, column


def gradient(shape: torch.Size, step: int, which: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + which)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def train(params: list[torch.Tensor], optimizer: StochasticAdamW) -> None:
    for step in range(STEPS):
        for which, param in enumerate(params):
            grad = gradient(param.shape, step, which)
            if isinstance(param, DTensor):
                grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
            param.grad = grad
        if step == 2:
            optimizer.scale_gradients(torch.tensor(0.25))
        optimizer.step()
        optimizer.zero_grad()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sharded_run() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    mismatches: list[str] = []
    memory: list[tuple[int | None, int]] = []
    for options in OPTIONS:
        model, column = model_and_column()
        reference = [p.detach().clone().requires_grad_() for p in [*model.parameters(), column]]
        fully_shard(model, mesh=mesh)
        tp_column = nn.Parameter(distribute_tensor(column.detach(), mesh, [Shard(1)]))
        params = [*model.parameters(), tp_column]
        # the shards step 5 elements at a time, one process whole: chunking and sharding change no bit
        optimizer = StochasticAdamW(params, lr=1e-2, weight_decay=0.1, seed=5, chunk_elements=5, **options)
        reference_optimizer = StochasticAdamW(reference, lr=1e-2, weight_decay=0.1, seed=5, **options)
        train(params, optimizer)
        train(reference, reference_optimizer)
        for i, (param, expected) in enumerate(zip(params, reference, strict=True)):
            if not torch.equal(full(param), expected):
                mismatches.append(f"{options} param {i}")
            for key, value in reference_optimizer.state[expected].items():
                if not torch.equal(full(optimizer.state[param][key]), value):
                    mismatches.append(f"{options} {key} {i}")
        even = [p for p in params if p.shape[0] % 2 == 0]  # the plan counts a sharded dim's share as size / 2
        plan = plan_memory(
            even, optimizer_states=optimizer_states_per_parameter(optimizer), config=None, activations=None
        )
        held = sum(
            v.to_local().numel() * v.element_size()
            for p in even
            for k, v in optimizer.state[p].items()
            if k != "step"
        )
        memory.append((plan.optimizer, held))
    model, _ = model_and_column()
    fully_shard(model, mesh=mesh)
    indices_match = all(
        torch.equal(
            global_element_index(p),
            distribute_tensor(
                torch.arange(p.numel()).view(p.shape), mesh, p.placements, src_data_rank=None
            ).to_local(),
        )
        for p in model.parameters()
    )
    uneven = [tuple(p.to_local().shape) for p in model.parameters() if p.shape[0] == 5]
    return {"mismatches": mismatches, "memory": memory, "indices": indices_match, "uneven": uneven}


def test_sharded_parameters_step_as_on_one_process_bit_for_bit() -> None:
    results = run_distributed(sharded_run, 2)
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}"
        assert result["indices"], f"rank {rank}"
        assert all(plan == held for plan, held in result["memory"]), f"rank {rank}: {result['memory']}"
    assert [r["uneven"] for r in results] == [[(3, 6), (3,)], [(2, 6), (2,)]]  # the uneven split is exercised


def global_indices_on_a_2d_mesh() -> list[bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    values = torch.arange(8 * 3).view(8, 3)  # each element its own global index
    layouts = (
        [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP over a tp-sharded dim (torch's strided layout)
        [Shard(0), Shard(1)],
        [Shard(1), Shard(0)],
        [_StridedShard(0, split_factor=2), Replicate()],  # rows 0-1 and 4-5 on dp rank 0: not contiguous
    )
    shards = [distribute_tensor(values, mesh, placements) for placements in layouts]
    whole = [torch.equal(global_element_index(shard), shard.to_local()) for shard in shards]
    chunked = [  # 4 elements at a time, as a chunked step asks for them
        torch.equal(
            torch.cat(
                [
                    flat_global_index(
                        axis_offsets(shard),
                        tuple(shard.to_local().shape),
                        tuple(shard.shape),
                        start,
                        min(start + 4, shard.to_local().numel()),
                        shard.device,
                    )
                    for start in range(0, shard.to_local().numel(), 4)
                ]
            ),
            shard.to_local().reshape(-1),
        )
        for shard in shards
    ]
    return whole + chunked


def test_global_indices_follow_strided_and_2d_shards() -> None:
    assert run_distributed(global_indices_on_a_2d_mesh, 4) == [[True] * 8] * 4
