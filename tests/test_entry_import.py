"""``import lightning_d9d`` is light (no Lightning: ``python -m lightning_d9d.convert --help`` answers without it) and
still registers ``Trainer(strategy="d9d")`` and ``Fabric(strategy="d9d")``, whichever package is imported first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry

import lightning_d9d
from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.strategies import D9DStrategy

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=300, check=False
    )


def _lightning_modules(importtime_log: str) -> list[str]:
    """Modules of Lightning (not lightning_d9d) that ``-X importtime`` saw imported."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if "|" in line]
    return [name for name in names if name == "lightning" or name.startswith("lightning.")]


def test_convert_help_imports_no_lightning() -> None:
    start = time.perf_counter()
    proc = _run("-X", "importtime", "-m", "lightning_d9d.convert", "--help")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dcp-to-hf" in proc.stdout
    print(f"python -m lightning_d9d.convert --help: {seconds:.1f} s (wall, this machine's load included)")
    assert _lightning_modules(proc.stderr) == []


def test_strategy_name_registered_when_lightning_is_imported_later() -> None:
    script = (
        "import sys, lightning_d9d\n"
        "assert 'lightning' not in sys.modules, 'import lightning_d9d imported Lightning'\n"
        "import lightning as L\n"
        "trainer = L.Trainer(strategy='d9d', accelerator='cpu', devices=1, logger=False)\n"
        "fabric = L.Fabric(strategy='d9d', accelerator='cpu', devices=1)\n"
        "print(type(trainer.strategy).__name__, type(fabric.strategy).__name__)\n"
    )
    proc = _run("-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "D9DStrategy D9DFabricStrategy"


def test_strategy_name_registered_when_lightning_was_imported_first() -> None:
    # This process imported Lightning before lightning_d9d (above); register on a fresh registry the same way.
    registry, fabric_registry = _StrategyRegistry(), _StrategyRegistry()
    for _ in range(2):  # twice: no error
        lightning_d9d._register_trainer_strategy(type("Module", (), {"StrategyRegistry": registry}))  # type: ignore[arg-type]
        lightning_d9d._register_fabric_strategy(type("Module", (), {"STRATEGY_REGISTRY": fabric_registry}))  # type: ignore[arg-type]
    assert isinstance(registry.get("d9d"), D9DStrategy)
    assert isinstance(fabric_registry.get("d9d"), D9DFabricStrategy)


@pytest.mark.parametrize("name", lightning_d9d.__all__)
def test_public_names_load_on_access(name: str) -> None:
    assert getattr(lightning_d9d, name) is not None


def test_metrics_are_public_names() -> None:
    from lightning_d9d.modules import metrics

    assert {"CausalLMPerplexity", "TokenAccuracy"} <= set(lightning_d9d.__all__)
    assert lightning_d9d.CausalLMPerplexity is metrics.CausalLMPerplexity
    assert lightning_d9d.TokenAccuracy is metrics.TokenAccuracy


def test_import_loads_no_torchmetrics() -> None:
    proc = _run("-c", "import sys, lightning_d9d\nprint('torchmetrics' in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"
