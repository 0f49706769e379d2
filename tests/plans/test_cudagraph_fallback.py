"""CUDA graphs (``compile="reduce-overhead"`` / ``"max-autotune"``) are kept only where they can replay: the plan
falls back to the same mode without them under FSDP, pipelines and expert parallelism, and says why once; MoE
blocks on one rank keep them, and the one MoE operator that reads the host tells Inductor so itself."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

import lightning_d9d.plans.blocks as blocks_plan
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.modules.moe import MoE
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.plans.compile import (
    EXPERT_PARALLEL_REASON,
    FSDP_REASON,
    PIPELINE_REASON,
    cudagraph_fallback,
    uses_cudagraphs,
)


@pytest.mark.parametrize(
    ("mode", "flags", "expected"),
    [
        # nothing in the way: the CUDA-graph modes stay
        ("reduce-overhead", {}, ("reduce-overhead", None)),
        ("max-autotune", {}, ("max-autotune", None)),
        # each obstacle alone, for both CUDA-graph modes
        ("reduce-overhead", {"fsdp_sharded": True}, ("default", FSDP_REASON)),
        ("max-autotune", {"fsdp_sharded": True}, ("max-autotune-no-cudagraphs", FSDP_REASON)),
        ("reduce-overhead", {"pipelined": True}, ("default", PIPELINE_REASON)),
        ("max-autotune", {"pipelined": True}, ("max-autotune-no-cudagraphs", PIPELINE_REASON)),
        ("reduce-overhead", {"expert_parallel": True}, ("default", EXPERT_PARALLEL_REASON)),
        ("max-autotune", {"expert_parallel": True}, ("max-autotune-no-cudagraphs", EXPERT_PARALLEL_REASON)),
        # several: FSDP is named first (the one a user can change on one GPU), then the pipeline
        (
            "reduce-overhead",
            {"fsdp_sharded": True, "pipelined": True, "expert_parallel": True},
            ("default", FSDP_REASON),
        ),
        ("reduce-overhead", {"pipelined": True, "expert_parallel": True}, ("default", PIPELINE_REASON)),
        # modes without CUDA graphs never change and give no reason
        ("default", {"fsdp_sharded": True, "pipelined": True, "expert_parallel": True}, ("default", None)),
        (
            "max-autotune-no-cudagraphs",
            {"fsdp_sharded": True, "pipelined": True, "expert_parallel": True},
            ("max-autotune-no-cudagraphs", None),
        ),
    ],
)
def test_cudagraph_fallback(mode: str, flags: dict[str, bool], expected: tuple[str, str | None]) -> None:
    arguments = {"fsdp_sharded": False, "pipelined": False, "expert_parallel": False, **flags}
    assert cudagraph_fallback(mode, **arguments) == expected


def test_reasons_name_what_to_change() -> None:
    assert "fsdp_on_one_rank=False" in FSDP_REASON
    assert "pp=1" in PIPELINE_REASON
    assert "ep=1" in EXPERT_PARALLEL_REASON
    assert [uses_cudagraphs(m) for m in ("reduce-overhead", "max-autotune", "default", None)] == [
        True,
        True,
        False,
        False,
    ]
    assert not uses_cudagraphs("max-autotune-no-cudagraphs")


class Net(nn.Module):
    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        block = (
            (lambda: MoE(8, num_experts=2, top_k=1, intermediate_size=8))
            if moe
            else (lambda: nn.Linear(8, 8))
        )
        self.layers = nn.ModuleList(nn.Sequential(block(), nn.Tanh()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def record_compile(monkeypatch: Any | None = None) -> list[str]:
    """What ``apply_compile`` is given, instead of compiling (seconds per block on CPU)."""
    modes: list[str] = []

    def fake(blocks: nn.ModuleList, mode: str = "default") -> None:
        modes.append(mode)

    if monkeypatch is not None:
        monkeypatch.setattr(blocks_plan, "apply_compile", fake)
    else:
        blocks_plan.apply_compile = fake  # type: ignore[assignment]
    return modes


def fsdp_rank(compile: str) -> dict[str, Any]:
    modes = record_compile()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("lightning_d9d.plans").addHandler(handler)
    model = Net()
    dims = ParallelDims(dp_shard=1).build_mesh("cpu")
    blocks_plan.parallelize_blocks(model, [model.layers], dims, ParallelOptions(compile=compile))
    return {"modes": modes, "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}


@pytest.mark.parametrize(
    ("compile", "fallback"), [("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")]
)
def test_blocks_under_fsdp_compile_without_cudagraphs_and_say_why(compile: str, fallback: str) -> None:
    # FSDP wraps the blocks on one rank too (fsdp_on_one_rank defaults to True)
    (result,) = run_distributed(fsdp_rank, 1, compile, timeout=120)
    assert result["modes"] == [fallback]
    (warning,) = result["warnings"]
    assert f"compile={compile!r}" in warning and f"mode {fallback!r}" in warning
    assert FSDP_REASON in warning


def test_blocks_without_fsdp_keep_cudagraphs(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    modes = record_compile(monkeypatch)
    model = Net()
    dims = ParallelDims(dp_shard=1).resolve(1)  # one rank, no mesh needed: nothing wraps the blocks
    options = ParallelOptions(compile="reduce-overhead", fsdp_on_one_rank=False)
    with caplog.at_level(logging.WARNING, logger="lightning_d9d.plans"):
        blocks_plan.parallelize_blocks(model, [model.layers], dims, options)
    assert modes == ["reduce-overhead"]
    assert not [r for r in caplog.records if r.name == "lightning_d9d.plans"]


@pytest.mark.parametrize(
    "moe", [None, True]
)  # found in the blocks, or said by the caller (transformers' plans)
def test_moe_blocks_on_one_rank_keep_cudagraphs(
    monkeypatch: pytest.MonkeyPatch, caplog: Any, moe: bool | None
) -> None:
    modes = record_compile(monkeypatch)
    model = Net(moe=moe is None)
    dims = ParallelDims(dp_shard=1).resolve(1)
    options = ParallelOptions(compile="reduce-overhead", fsdp_on_one_rank=False)
    with caplog.at_level(logging.WARNING, logger="lightning_d9d.plans"):
        blocks_plan.parallelize_blocks(model, [model.layers], dims, options, moe=moe)
    assert modes == ["reduce-overhead"]
    assert not [r for r in caplog.records if r.name == "lightning_d9d.plans"]


def test_the_host_reading_grouped_gemm_keeps_its_graph_out_of_cuda_graphs() -> None:
    """The ``loop`` grouped GEMM reads the group sizes on the host: its operators carry torch's
    ``cudagraph_unsafe`` tag, which Inductor's check finds in a traced graph (CUDA graphs are then skipped for
    that graph, and only that one), while torch's grouped GEMM traces to no such node."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    from lightning_d9d.kernels import grouped_mm

    # bf16: what torch's grouped GEMM takes on CPU
    x = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([4, 2])

    def first_unsafe(backend: str) -> list[Any]:
        """The first cudagraph-unsafe node of the forward and of the backward graph that Inductor would get."""
        graphs: list[torch.fx.GraphModule] = []

        def keep(graph: torch.fx.GraphModule, inputs: Any) -> Any:
            graphs.append(graph)
            return make_boxed_func(graph.forward)

        torch._dynamo.reset()
        step = torch.compile(
            lambda x, w: grouped_mm(x, w, sizes, backend=backend),
            backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
            fullgraph=True,
        )
        step(x, w).sum().backward()
        return [get_first_incompatible_cudagraph_node(graph) for graph in graphs]

    forward, backward = first_unsafe("loop")
    assert forward is not None and forward.target is torch.ops.lightning_d9d.loop_grouped_mm.default
    assert (
        backward is not None and backward.target is torch.ops.lightning_d9d.loop_grouped_mm_backward.default
    )
    assert first_unsafe("torch") == [None, None]
    for op in (torch.ops.lightning_d9d.loop_grouped_mm, torch.ops.lightning_d9d.loop_grouped_mm_backward):
        assert torch.Tag.cudagraph_unsafe in op.default.tags


def test_the_strategy_marks_cudagraph_steps_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_d9d import D9DStrategy

    marks: list[None] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(None))
    for compile, device, expected in (
        ("reduce-overhead", "cuda", 1),
        ("max-autotune", "cuda", 1),
        (True, "cuda", 0),
        ("max-autotune-no-cudagraphs", "cuda", 0),
        ("reduce-overhead", "cpu", 0),
    ):
        strategy = D9DStrategy(compile=compile)
        monkeypatch.setattr(D9DStrategy, "root_device", property(lambda self, d=device: torch.device(d)))
        marks.clear()
        strategy._mark_cudagraph_step()
        assert len(marks) == expected, (compile, device)
