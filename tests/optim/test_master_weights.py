"""``MasterWeightAdamW``: bf16 parameters, fp32 masters in the optimizer. Each step is torch's AdamW on the fp32
masters (bit for bit on CPU), the Triton step equals the reference, a checkpoint keeps the masters in fp32 and a
resume continues exactly, the strategy clips inside the step and refuses the runs it cannot train right."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy
from lightning_d9d.kernels.adamw import AdamWHyper, adamw_master_step_reference, adamw_master_step_triton
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.optim import MasterWeightAdamW
from lightning_d9d.state.training import load, optimizer_state, save
from lightning_d9d.strategies.precision import D9DPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pretrain_qwen3 import Qwen3Pretraining, SyntheticCorpus

LR, DECAY = 2e-2, 0.1


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        yield


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.tiny())
    model.init_weights()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, Qwen3Config.tiny().vocab_size, (2, 17), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups, as a user writes them: no decay and a larger rate for the norms."""
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    rest = [p for name, p in model.named_parameters() if "norm" not in name]
    return [{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": 2 * LR}]


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    inputs, labels = batch(step)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return causal_lm_loss(model(inputs), labels)


def scale_of(step: int) -> torch.Tensor | None:
    """Step 2's gradients are scaled (as norm clipping does): the scale goes into the step."""
    return torch.tensor(0.25) if step == 2 else None


# ----------------------------------------------------------------------------------------------- the step
def test_each_step_is_torch_adamw_on_fp32_masters() -> None:
    """The definition, with torch's own AdamW doing the math: bf16 parameters compute, their gradients upcast to
    fp32 masters that ``torch.optim.AdamW`` steps, and the parameters become the masters rounded."""
    model = tiny_model()
    reference = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = MasterWeightAdamW(groups(model), lr=LR, betas=(0.9, 0.95), weight_decay=DECAY)
    masters = {p: p.detach().clone().requires_grad_() for p in reference.parameters()}
    reference_optimizer = torch.optim.AdamW(
        [{**g, "params": [masters[p] for p in g["params"]]} for g in groups(reference)],
        lr=LR,
        betas=(0.9, 0.95),
        weight_decay=DECAY,
        foreach=False,
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for step in range(5):
        with torch.no_grad():
            for param, master in masters.items():
                param.data = master.detach().to(torch.bfloat16)
        ours, theirs = loss_of(model, step), loss_of(reference, step)
        assert torch.equal(ours, theirs)
        ours.backward()
        theirs.backward()
        scale = scale_of(step)
        for param, master in masters.items():
            assert param.grad is not None
            master.grad = param.grad.float() * (1.0 if scale is None else scale)
            param.grad = None
        if scale is not None:
            optimizer.scale_gradients(scale)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
    for (name, param), master in zip(model.named_parameters(), masters.values(), strict=True):
        state, expected = optimizer.state[param], reference_optimizer.state[master]
        assert state["master"].dtype == torch.float32
        assert torch.equal(state["master"], master.detach()), name
        assert torch.equal(state["exp_avg"], expected["exp_avg"]), name
        assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"]), name
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16)), name
        assert not torch.equal(param.detach(), initial[name].to(torch.bfloat16)), (
            name
        )  # every parameter trained


@pytest.mark.parametrize("numel", [1000, 2 * 4096 + 5])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_triton_step_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch, numel: int, scaled: bool
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(numel)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator).to(torch.bfloat16)
    exp_avg = torch.randn(numel, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, generator=generator) * 0.01
    hyper = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    scale = torch.tensor([0.3]) if scaled else None
    expected = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq)] + [
        torch.empty(numel, dtype=torch.bfloat16)
    ]
    got = [t.clone() for t in (master, grad, exp_avg, exp_avg_sq)] + [
        torch.empty(numel, dtype=torch.bfloat16)
    ]
    adamw_master_step_reference(*expected, hyper, scale)
    adamw_master_step_triton(*got, hyper, scale)
    for name, g, e in zip(("master", "grad", "exp_avg", "exp_avg_sq"), got, expected, strict=False):
        # fp32 rounding: torch's CPU lerp fuses a multiply-add that numpy (the interpreter) rounds twice, one
        # fp32 step at the tensor's scale where the moment cancels to near zero
        torch.testing.assert_close(g, e, rtol=1e-6, atol=2**-23 * float(e.float().abs().max()), msg=name)
    # the interpreter truncates fp32 -> bf16 where a GPU rounds: within one bf16 step of the master
    assert ((got[4].float() - got[0]).abs() <= got[0].abs() * 2**-7).all()


# ---------------------------------------------------------------------------------------------- checkpoints
def trained(seed: int, steps: int) -> tuple[Qwen3ForCausalLM, MasterWeightAdamW]:
    model = tiny_model(seed)
    optimizer = MasterWeightAdamW(groups(model), lr=LR, betas=(0.9, 0.95), weight_decay=DECAY)
    train(model, optimizer, range(steps))
    return model, optimizer


def train(model: nn.Module, optimizer: MasterWeightAdamW, steps: range) -> None:
    for step in steps:
        loss_of(model, step).backward()
        scale = scale_of(step)
        if scale is not None:
            optimizer.scale_gradients(scale)
        optimizer.step()
        optimizer.zero_grad()


def state_of(model: nn.Module, optimizer: MasterWeightAdamW) -> dict[str, torch.Tensor]:
    state = {f"param.{name}": p.detach().clone() for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            state[f"{key}.{name}"] = value.detach().clone()
    return state


def test_a_checkpoint_keeps_the_fp32_masters_and_a_resume_continues_exactly(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0, steps=3)
    checkpoint = {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer_states": [optimizer_state(model, optimizer)],
    }
    save(tmp_path / "ckpt", checkpoint)
    other, other_optimizer = trained(seed=1, steps=1)
    load(tmp_path / "ckpt", other, {0: other_optimizer}, strict=True, weights_only=True)
    saved, loaded = state_of(model, optimizer), state_of(other, other_optimizer)
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype, key  # the masters and moments stay fp32 through the load
        assert torch.equal(loaded[key], value), key
    for param in other.parameters():  # the parameter is its loaded master, and the step updates both together
        assert param._lightning_d9d_master is other_optimizer.state[param]["master"]
    train(model, optimizer, range(3, 5))
    train(other, other_optimizer, range(3, 5))
    for key, value in state_of(model, optimizer).items():
        assert torch.equal(state_of(other, other_optimizer)[key], value), key


def test_a_second_optimizer_over_the_same_parameters_finds_their_masters() -> None:
    """A second ``fit`` builds a new optimizer over parameters that are bf16 by then."""
    model, optimizer = trained(seed=0, steps=2)
    masters = {p: optimizer.state[p]["master"] for p in model.parameters()}
    again = MasterWeightAdamW(model.parameters(), lr=LR)
    assert all(again.state[p]["master"] is master for p, master in masters.items())
    with pytest.raises(TypeError, match="fp32 parameters"):
        MasterWeightAdamW([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))])


# ---------------------------------------------------------------------------------------------- clipping
def test_norm_clipping_goes_into_the_step_in_fp32() -> None:
    """The strategy's clipping hands a master-weight optimizer its coefficient instead of rewriting the bf16
    gradients; the norm is taken in fp32 (a bf16 norm is 2**-9 off)."""
    model = tiny_model()
    optimizer = MasterWeightAdamW(model.parameters(), lr=LR)
    loss_of(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    fp32 = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    D9DPrecision("bf16-mixed").clip_grad_by_norm(optimizer, 0.01)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert optimizer._grad_scale is not None
    expected = 0.01 / (fp32 + 1e-6)
    assert expected < 0.5  # the clipping bites
    torch.testing.assert_close(optimizer._grad_scale.double(), expected.reshape(1), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- the Trainer
class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def fit(
    master_weights: bool,
    steps: int = 8,
    *,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
    resume_from: Path | None = None,
    **trainer_kwargs: Any,
) -> tuple[Qwen3Pretraining, list[float]]:
    L.seed_everything(0, verbose=False)
    config = Qwen3Config.tiny()
    module = Qwen3Pretraining(config, lr=1e-2, warmup_steps=1, max_steps=8, master_weights=master_weights)
    losses = Losses()
    options: dict[str, Any] = {
        "strategy": D9DStrategy(fsdp_on_one_rank=False),
        "precision": "bf16-mixed",
        "gradient_clip_val": 1.0,
        **trainer_kwargs,
    }
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=[losses, *callbacks],
        **options,
    )
    data = SyntheticCorpus(config.vocab_size, 32, 4)  # one batch, every step: the loss must fall
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=resume_from)
    return module, losses.losses


def test_the_trainer_trains_as_with_fp32_parameters() -> None:
    """Under the strategy, the run tracks the fp32-parameter run (autocast alike; the masters' run keeps a bf16
    residual stream), and the parameters it leaves are bf16 copies of fp32 masters."""
    module, losses = fit(master_weights=True)
    _, fp32_losses = fit(master_weights=False)
    assert losses[-1] < 0.7 * losses[0]
    assert max(abs(a - b) / b for a, b in zip(losses, fp32_losses, strict=True)) < 0.005
    assert module.model is not None
    for param in module.model.parameters():
        assert param.dtype == torch.bfloat16
        master = param._lightning_d9d_master
        assert master.dtype == torch.float32 and torch.equal(param.detach(), master.to(torch.bfloat16))


def test_a_trainer_resume_continues_the_masters_exactly(tmp_path: Path) -> None:
    """Saved at step 3 through the strategy's checkpoint (DCP), resumed to step 6: every master, moment and
    parameter as in the run that never stopped."""
    uninterrupted, _ = fit(master_weights=True, steps=6)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(master_weights=True, steps=3, callbacks=[checkpoints])
    resumed, resumed_losses = fit(master_weights=True, steps=6, resume_from=tmp_path / "step=3.ckpt")
    assert len(resumed_losses) == 3  # it resumed: steps 4-6 only
    assert uninterrupted.model is not None and resumed.model is not None
    expected_state, resumed_state = (
        module.trainer.optimizers[0].state for module in (uninterrupted, resumed)
    )
    for (name, expected), param in zip(
        uninterrupted.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(param, expected), name
        assert int(resumed_state[param]["step"]) == 6
        for key in ("master", "exp_avg", "exp_avg_sq"):
            got, want = resumed_state[param][key], expected_state[expected][key]
            assert got.dtype == torch.float32 and torch.equal(got, want), f"{key} of {name}"


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"precision": "32-true"}, ValueError, "precision='32-true'"),
        ({"strategy": D9DStrategy()}, TypeError, "DTensor"),
        ({"accumulate_grad_batches": 2}, ValueError, "accumulate_grad_batches=2"),
    ],
)
def test_runs_it_cannot_train_right_are_refused(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        fit(master_weights=True, steps=1, **options)


# ---------------------------------------------------------------------------------------------- Fabric
def test_fabric_takes_it_over_the_set_up_model_and_clips_in_the_step() -> None:
    from lightning_d9d import D9DFabricStrategy

    fabric = L.Fabric(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        strategy=D9DFabricStrategy(fsdp_on_one_rank=False),
    )
    fabric.launch()
    with pytest.raises(ValueError, match="build it over the set-up model"):
        model = tiny_model()
        fabric.setup(model, MasterWeightAdamW(model.parameters()))
    model = fabric.setup_module(tiny_model())
    optimizer = fabric.setup_optimizers(MasterWeightAdamW(model.parameters(), lr=LR))
    inputs, labels = batch(0)
    with fabric.autocast():
        loss = causal_lm_loss(model(inputs), labels)
    fabric.backward(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    fabric.clip_gradients(model, optimizer, max_norm=0.01)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    scale = optimizer.optimizer._grad_scale
    assert scale is not None and float(scale) < 0.5
