"""D9DStrategy(async_tp=True): refused by name where torch's micro-pipelined TP cannot apply (tp = 1, compile
off, not CUDA), before any process group; where it applies, Inductor's pass is switched on and the tp group is
registered with symmetric memory once the mesh exists. The fused operators themselves run only on CUDA GPUs
(``benchmarks/h200x2_runs.sh asynctp`` runs them at tp=2)."""

from __future__ import annotations

import lightning as L
import pytest
import torch._inductor.config as inductor_config
import torch.distributed as dist

from lightning_d9d import D9DFabricStrategy, D9DStrategy
from lightning_d9d.plans import async_tp


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tp": 1, "compile": True},
            "async_tp=True overlaps tensor-parallel collectives with matmuls, but tp=1",
        ),
        (
            {"tp": 2},
            "async_tp=True is an Inductor pass (torch's micro-pipelined TP) and needs the blocks compiled",
        ),
    ],
)
def test_refused_without_tp_or_compile(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        D9DStrategy(async_tp=True, **kwargs)
    D9DStrategy(tp=2, compile=True, async_tp=True)  # what it needs
    D9DStrategy(tp=1)  # off by default


def test_refused_off_cuda_before_any_process_group() -> None:
    with pytest.raises(ValueError, match=r"async_tp=True needs CUDA GPUs .* the accelerator is 'cpu'"):
        L.Trainer(strategy=D9DStrategy(tp=2, compile=True, async_tp=True), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"D9DFabricStrategy: async_tp=True needs CUDA GPUs"):
        L.Fabric(strategy=D9DFabricStrategy(tp=2, compile=True, async_tp=True), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"D9DFabricStrategy: async_tp=True .* needs the blocks compiled"):
        D9DFabricStrategy(tp=2, async_tp=True)
    assert not dist.is_initialized()


def test_enable_sets_inductors_flag_and_registers_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    registered: list[str] = []
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", registered.append)
    before = inductor_config._micro_pipeline_tp
    try:
        inductor_config._micro_pipeline_tp = False
        async_tp.enable_async_tp("tp_group")
        assert inductor_config._micro_pipeline_tp is True
        assert registered == ["tp_group"]
    finally:
        inductor_config._micro_pipeline_tp = before


def test_the_strategy_enables_it_with_its_tp_group_once_the_mesh_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """setup_environment on one process (a 1-rank gloo group, the device check passed as if on CUDA): the tp view's
    group name reaches enable_async_tp; the mesh is built first."""
    import lightning_d9d.strategies.topology as topology

    calls: list[str] = []
    monkeypatch.setattr(topology, "check_options_on_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(topology, "enable_async_tp", calls.append)
    strategy = D9DStrategy(tp=2, compile=True, async_tp=True)
    strategy._requested_dims = strategy._requested_dims.__class__(
        tp=1
    )  # one process here: the tp view is 1 rank
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    try:
        strategy._lightning_module = L.LightningModule()
        trainer.strategy.setup_environment()
        assert calls == [strategy.parallel_dims.mesh_for("tp").get_group().group_name]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fabric_enables_it_with_its_tp_group_once_the_mesh_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for Fabric's strategy: its setup_environment builds the mesh, then hands the tp group on."""
    import lightning_d9d.strategies.topology as topology

    calls: list[str] = []
    monkeypatch.setattr(topology, "check_options_on_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(topology, "enable_async_tp", calls.append)
    strategy = D9DFabricStrategy(tp=2, compile=True, async_tp=True)
    strategy._requested_dims = strategy._requested_dims.__class__(tp=1)  # one process: a 1-rank tp view
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    try:
        fabric.strategy.setup_environment()
        assert calls == [strategy._dims.mesh_for("tp").get_group().group_name]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
