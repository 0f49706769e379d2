"""``D9DFabricStrategy`` without a launch: what it refuses before any process starts, how an optimizer built
before sharding follows the parallel parameters, and how a Fabric state maps onto the training checkpoint."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_d9d.fabric import D9DFabricStrategy
from lightning_d9d.fabric import checkpoint as fabric_checkpoint
from lightning_d9d.fabric.strategy import _check_rebindable, _rebind
from lightning_d9d.state import training as training_checkpoint


def test_pipelines_are_refused_naming_the_trainer() -> None:
    with pytest.raises(ValueError, match=r"pp=2.*Trainer\(strategy=D9DStrategy\(pp=2"):
        D9DFabricStrategy(pp=2)


def test_a_mesh_that_does_not_tile_the_world_fails_before_launch() -> None:
    with pytest.raises(ValueError, match="tp"):
        L.Fabric(accelerator="cpu", devices=2, strategy=D9DFabricStrategy(tp=3))


def test_registered_name_builds_the_strategy() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="d9d")
    assert isinstance(fabric.strategy, D9DFabricStrategy)


@pytest.mark.parametrize(("precision", "kept"), [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed")])
def test_fabric_precisions_become_the_strategy_plugin(precision: str, kept: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="d9d", precision=precision)  # type: ignore[arg-type]
    assert fabric.strategy.precision.precision == kept
    policy = fabric.strategy.precision.mixed_precision_policy()
    assert (policy is not None) == (precision == "bf16-mixed")  # FSDP's policy casts, not autocast


def test_an_unsupported_precision_is_refused_naming_the_choices() -> None:
    with pytest.raises(TypeError, match=r"precision='16-true'.*'bf16-mixed'"):
        L.Fabric(accelerator="cpu", devices=1, strategy="d9d", precision="16-true")


class Wrapped(nn.Module):
    """A block that activation checkpointing wrapped after the optimizer was built."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = inner


def test_an_optimizer_follows_its_parameters_by_name_through_wrappers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    optimizer = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[1].bias]}], lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    _check_rebindable(optimizer, names)
    model[0] = Wrapped(nn.Linear(3, 3))  # new parameters under a wrapper, as a plan would leave them
    model[1].bias = nn.Parameter(torch.zeros(2))
    _rebind(optimizer, names, model)
    assert optimizer.param_groups[0]["params"][0] is model[0]._checkpoint_wrapped_module.weight
    assert optimizer.param_groups[1]["params"][0] is model[1].bias


def test_an_optimizer_that_stepped_or_holds_other_parameters_is_refused() -> None:
    model = nn.Linear(2, 2)
    names = {id(p): n for n, p in model.named_parameters()}
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(4, 5))], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(4, 5\) that is not the model's"):
        _check_rebindable(stranger, names)
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="set it up before its first step"):
        _check_rebindable(stepped, names)


def test_a_renamed_parameter_names_the_setup_that_works() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    renamed = nn.Sequential(nn.Identity(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'0.weight'.*fabric.setup_module\(model\)"):
        _rebind(optimizer, names, renamed)


class Counter:
    """A stateful object of the user's (``state_dict`` / ``load_state_dict``), as Fabric saves them."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_fabric_state_round_trips_through_the_training_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _trained(0)
    path = tmp_path / "ckpt"
    state = {"model": model, "opt": optimizer, "step": 12, "counter": Counter(5), "note": {"lr": 0.1}}
    training_checkpoint.save(path, fabric_checkpoint.to_checkpoint(state))
    assert training_checkpoint.is_training_checkpoint(path) and (path / "manifest.json").is_file()

    other, other_optimizer = _trained(1)
    counter = Counter(0)
    target = {"model": other, "opt": other_optimizer, "step": 0, "counter": counter}
    values, remainder = fabric_checkpoint.load_into(path, target, strict=True, weights_only=None)
    assert values == {"step": 12} and counter.value == 5 and remainder == {"note": {"lr": 0.1}}
    for (name, saved), loaded in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0, msg=name)
    saved_state = optimizer.state_dict()["state"]
    for index, entry in other_optimizer.state_dict()["state"].items():
        torch.testing.assert_close(entry["exp_avg"], saved_state[index]["exp_avg"], rtol=0, atol=0)


def _parameters_and_moments(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    for index, entry in optimizer.state_dict()["state"].items():
        state[f"exp_avg.{index}"] = entry["exp_avg"].clone()
    return state


def test_a_refused_load_leaves_the_model_and_optimizer_untouched(tmp_path: Path) -> None:
    """Other optimizer names, or (strict) an entry the checkpoint lacks: refused before anything is loaded, so
    the model keeps its own weights, not the checkpoint's."""
    model, optimizer = _trained(0)
    path = tmp_path / "ckpt"
    training_checkpoint.save(path, fabric_checkpoint.to_checkpoint({"model": model, "opt": optimizer}))
    other, other_optimizer = _trained(1)
    before = _parameters_and_moments(other, other_optimizer)
    with pytest.raises(KeyError, match=r"\['opt'\].*names \['optimizer'\]"):
        fabric_checkpoint.load_into(
            path, {"model": other, "optimizer": other_optimizer}, strict=True, weights_only=None
        )
    with pytest.raises(KeyError, match=r"no entry 'step'.*strict=False"):
        fabric_checkpoint.load_into(
            path, {"model": other, "opt": other_optimizer, "step": 0}, strict=True, weights_only=None
        )
    after = _parameters_and_moments(other, other_optimizer)
    for name, value in before.items():
        torch.testing.assert_close(
            after[name], value, rtol=0, atol=0, msg=f"{name} changed by a refused load"
        )
    values, _ = fabric_checkpoint.load_into(
        path, {"model": other, "opt": other_optimizer, "step": 0}, strict=False, weights_only=None
    )
    assert values == {}
    torch.testing.assert_close(
        other.state_dict(), model.state_dict(), rtol=0, atol=0
    )  # what the refusals kept out


def test_a_state_needs_exactly_one_model() -> None:
    with pytest.raises(ValueError, match=r"exactly one model.*found 2 \(a, b\)"):
        fabric_checkpoint.to_checkpoint({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)})
    with pytest.raises(ValueError, match="found none"):
        fabric_checkpoint.to_checkpoint({"step": 1})
