"""The block plan: checkpointing, then compile, then one FSDP unit per block; the default plan keeps dropout exact."""

from __future__ import annotations

import copy
from typing import Any

import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule

import lightning_d9d.plans.blocks as blocks_plan
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans import ParallelOptions, parallelize_default


class DropoutNet(nn.Module):
    """A user model without a plan: the default plan finds ``layers`` as its repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # the same dropout masks for both models
    model(x).square().sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert grad is not None, name
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name.replace("._checkpoint_wrapped_module", "")] = grad
    return grads


def default_plan_rank() -> dict[str, Any]:
    compiled: list[tuple[list[type], str]] = []
    # Record what compile is given instead of compiling (seconds per block on CPU): the order is the point.
    blocks_plan.apply_compile = lambda blocks, mode: compiled.append(([type(b) for b in blocks], mode))  # type: ignore[assignment]
    torch.manual_seed(0)
    model = DropoutNet()
    reference = copy.deepcopy(model)
    dims = ParallelDims(dp_shard=1).build_mesh("cpu")
    parallelize_default(
        model, dims, ParallelOptions(activation_checkpointing=True, compile="max-autotune-no-cudagraphs")
    )
    x = torch.randn(8, 16)
    return {
        "compiled": compiled,
        "units": [
            (isinstance(layer, CheckpointWrapper), isinstance(layer, FSDPModule)) for layer in model.layers
        ],
        "root_is_fsdp": isinstance(model, FSDPModule),
        "grads": loss_and_grads(model, x),
        "expected": loss_and_grads(reference, x),
    }


def test_default_plan_checkpoints_then_compiles_then_shards_and_keeps_dropout_exact() -> None:
    (result,) = run_distributed(default_plan_rank, 1, timeout=120)
    # compile saw the checkpoint wrappers (before FSDP), in the mode asked for; FSDP made each wrapper a unit,
    # then the root.
    assert result["compiled"] == [([CheckpointWrapper, CheckpointWrapper], "max-autotune-no-cudagraphs")]
    assert result["units"] == [(True, True), (True, True)]
    assert result["root_is_fsdp"]
    expected = result["expected"]
    assert result["grads"].keys() == expected.keys()
    for name, grad in expected.items():
        # Without the preserved RNG state the recompute draws other dropout masks and this differs by O(1).
        torch.testing.assert_close(result["grads"][name], grad, msg=name)


def compile_flags_rank() -> list[bool]:
    from torch.distributed.fsdp import fully_shard

    from lightning_d9d.plans.compile import apply_compile

    dims = ParallelDims(dp_shard=1).build_mesh("cpu")
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    holding = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    # an inner unit, as the experts under ep or the MoE block under tp
    fully_shard(holding[1], mesh=dims.mesh_for("fsdp"))
    unit_itself = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=dims.mesh_for("fsdp"))
    flags: list[bool] = []
    # Record the flag instead of compiling: what matters is that dynamo never gets fullgraph=True for a block
    # whose inner FSDP hooks it cannot trace ("Attempted to call function marked as skipped").
    nn.Module.compile = lambda self, **kwargs: flags.append(kwargs["fullgraph"])  # type: ignore[method-assign]
    apply_compile(nn.ModuleList([plain, holding, unit_itself]))  # type: ignore[list-item]
    return flags


def test_blocks_holding_fsdp_units_compile_with_graph_breaks() -> None:
    (flags,) = run_distributed(compile_flags_rank, 1, timeout=120)
    # A block that is itself the unit traces whole: its hooks run outside the compiled forward.
    assert flags == [True, False, True]
