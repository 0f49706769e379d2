"""FSDP on one rank: ``reshard_after_forward=True`` frees each block's gathered parameters after forward.

FSDP2 "gathers" into a buffer of its own even on one rank (under bf16 mixed precision: the bf16 cast of the fp32
shard), so keeping it from forward to backward holds a second copy of every block's weights: 6.8 GiB at
Qwen3-4B's shape. The default (``None``) keeps it there, for speed; the one-rank plan used to keep it whatever
the option said.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans import ParallelOptions, parallelize_default


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def held_after_forward_rank(reshard: bool | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Blocks()
    dims = ParallelDims(dp_shard=1).build_mesh("cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallelize_default(model, dims, ParallelOptions(mp_policy=policy, reshard_after_forward=reshard))
    loss = model(torch.randn(4, 16)).float().square().sum()
    # Between forward and backward: a block that resharded has its sharded DTensor registered again; one that
    # kept its gathered parameters has the plain (bf16) tensor registered.
    held = [
        None if isinstance(layer[0].weight, DTensor) else str(layer[0].weight.dtype) for layer in model.layers
    ]
    loss.backward()
    return {"held": held, "grads": all(p.grad is not None for p in model.parameters())}


def test_one_rank_fsdp_frees_the_gathered_parameters_after_forward_when_asked() -> None:
    held = {
        reshard: run_distributed(held_after_forward_rank, 1, reshard, timeout=120)[0]
        for reshard in (True, None, False)
    }
    # The last block stays gathered either way: backward needs it at once (plans/fsdp.py).
    assert held[True]["held"] == [None, None, "torch.bfloat16"]
    assert held[None]["held"] == held[False]["held"] == ["torch.bfloat16"] * 3
    assert all(result["grads"] for result in held.values())
