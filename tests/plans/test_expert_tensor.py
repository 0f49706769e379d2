"""Expert-tensor parallelism's option, refusals and memory plan (``lightning_d9d/plans/expert_tensor.py``); its
training against one process and its checkpoints run in ``tests/models/hf/test_expert_tensor_parallel.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_d9d import D9DStrategy, LoRA
from lightning_d9d.compat import strided_shard_type
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.models import Qwen3MoeConfig
from lightning_d9d.plans.expert_tensor import check_expert_width
from lightning_d9d.plans.memory import ActivationShape, activation_bytes, local_numel


def test_both_strategies_take_the_option() -> None:
    assert D9DStrategy(tp=2, expert_tensor_parallel=True)._options.expert_tensor_parallel
    assert D9DFabricStrategy(tp=2, expert_tensor_parallel=True)._options.expert_tensor_parallel
    assert not D9DStrategy(tp=2)._options.expert_tensor_parallel


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"tp": 1}, ValueError, r"expert_tensor_parallel=True, tp=1\): .* set tp > 1"),
        (
            {"tp": 2, "ep": 2},
            NotImplementedError,
            r"expert_tensor_parallel=True, tp=2, ep=2\): .* use ep=2 with expert_tensor_parallel=False",
        ),
        (
            {"tp": 2, "lora": LoRA(experts=True)},
            NotImplementedError,
            r"expert_tensor_parallel=True, lora=LoRA\(experts=True\)\): the experts' adapters are not split",
        ),
        (
            {"tp": 2, "fp8": "rowwise", "fp8_experts": None},
            NotImplementedError,
            r"expert_tensor_parallel=True, fp8_experts=None\): the float8 grouped GEMM on expert shards",
        ),
    ],
    ids=["tp1", "ep", "lora_experts", "fp8_experts"],
)
def test_what_cannot_split_the_experts_over_tp_is_refused_by_name(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    for strategy in (D9DStrategy, D9DFabricStrategy):
        with pytest.raises(error, match=f"{strategy.__name__}\\({message}"):
            strategy(expert_tensor_parallel=True, **arguments)


def test_the_option_is_a_bool() -> None:
    with pytest.raises(
        TypeError, match=r"D9DStrategy\(expert_tensor_parallel=...\) takes True or False, got 2"
    ):
        D9DStrategy(tp=2, expert_tensor_parallel=2)  # type: ignore[arg-type]


def test_an_expert_width_tp_does_not_divide_is_refused() -> None:
    check_expert_width(32, 2, "Qwen3MoeForCausalLM")
    with pytest.raises(
        ValueError, match=r"Qwen3MoeForCausalLM: tp \(2\) must divide the experts' width \(33\)"
    ):
        check_expert_width(33, 2, "Qwen3MoeForCausalLM")


def test_the_memory_plan_counts_each_rank_s_share_of_a_split_expert() -> None:
    """The fused gate/up weight's strided shard counts as a shard (``local_numel``), like the down weight's."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())  # the autouse guard destroys it
    mesh = init_device_mesh("cpu", (2,))
    gate_up = distribute_tensor(torch.zeros(8, 64, 2 * 32), mesh, [strided_shard_type()(2, split_factor=2)])
    down = distribute_tensor(torch.zeros(8, 32, 64), mesh, [Shard(1)])
    assert local_numel(nn.Parameter(gate_up)) == gate_up.to_local().numel() == 8 * 64 * 32
    assert local_numel(nn.Parameter(down)) == down.to_local().numel() == 8 * 16 * 64


def test_the_activation_estimate_keeps_the_tp_group_s_expert_rows() -> None:
    """Split over tp, each rank keeps the expert rows (their hidden-wide inputs and outputs) of the tp group's
    tokens, tp times its own; the ffn-wide parts are 1/tp as wide, the same elements."""
    config = Qwen3MoeConfig.tiny()  # hidden 64, 8 experts of width 32, top-2
    shape = ActivationShape(tokens=4096, layers=3, head=False, tp=2)
    whole = activation_bytes(config, shape)
    split = activation_bytes(config, ActivationShape(**{**vars(shape), "expert_tensor_parallel": True}))
    assert whole is not None and split is not None
    # per token and layer: the top-2 rows' inputs and outputs (2 x 64 elements each) once more, over tp, 2 bytes
    assert split - whole == 4096 * 3 * (2 * 2 * 64) * 2 // 2
