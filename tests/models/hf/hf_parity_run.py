"""``Trainer(strategy=D9DStrategy(...))`` on a LightningModule around a tiny transformers causal LM, any degrees, on
N ranks forked from this process (torchrun's environment: Lightning launches nothing itself).

Usage: ``python hf_parity_run.py '<json list of runs>'``; a run has ``family``, ``layers``, ``devices``, ``dims``
(the strategy's arguments), ``batches``, optionally ``accumulate``, ``clip``, ``validate``, ``model`` (config
overrides), ``meta`` (built in ``configure_model`` on meta), ``exclude_experts``, ``lr``, ``compile_backend``
(``trainer_script.compile_backend``: what ``dims``' ``compile`` compiles with), ``load_hf`` /
``export_hf`` (directories for ``LoadHFWeights`` / ``ExportHF``), ``ckpt_dir`` + ``save_every`` (training
checkpoints named ``step=N.ckpt``) or ``resume_from`` (one of them), and ``out``: rank 0 saves there the
losses, the gradient norms before clipping, the final parameters (gathered from every pipeline rank), the
validation loss and what shows the plan was applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path[:0] = [
    str(HERE.parents[1]),
    str(HERE.parents[1] / "callbacks"),
    str(HERE.parents[1] / "strategies"),
    str(HERE),
]
import trainer_runs  # noqa: E402
from tiny_hf import (  # noqa: E402
    META_SEED,
    ROWS,
    exclude_experts,
    meta_initialised,
    optimizer_for,
    reference_run,
    samples,
    tiny_causal_lm,
    tiny_model,
)
from trainer_script import (  # noqa: E402
    RecordGradNorms,
    RecordLosses,
    compile_backend,
    full_parameters,
    timed,
)

from lightning_d9d import D9DStrategy, model_loss  # noqa: E402
from lightning_d9d.callbacks import ExpertLoadBalancing, ExportHF, LoadHFWeights  # noqa: E402
from lightning_d9d.models.hf import add_selection_bias  # noqa: E402
from lightning_d9d.modules.loss import causal_lm_loss  # noqa: E402


def inputs_of(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword inputs: the ids, and a packed batch's positions (by name: see docs/transformers.md)."""
    return {name: data[name] for name in ("input_ids", "position_ids") if name in data}


class HFCausalLM(L.LightningModule):
    def __init__(self, run: dict[str, Any]) -> None:
        super().__init__()
        self.run = run
        if not run.get("meta"):
            self.model = tiny_causal_lm(run["family"], layers=run["layers"], **run.get("model", {}))
            exclude_experts(self.model, run.get("exclude_experts", []))
            if run.get("selection_bias"):
                add_selection_bias(self.model)

    def configure_model(self) -> None:
        if self.run.get("meta") and not hasattr(self, "model"):
            # as our docs recommend for large models: built without memory, initialised by the strategy
            torch.manual_seed(META_SEED)  # the strategy's initialisation seed (rank 0's initial seed)
            with torch.device("meta"):
                self.model = tiny_model(
                    self.run["family"], layers=self.run["layers"], **self.run.get("model", {})
                )

    def on_train_start(self) -> None:
        self.start = gather_stages(full_parameters(self.model), self.run)

    def training_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = model_loss(self, self.model, inputs_of(data), data["labels"], causal_lm_loss)
        self.log("train/loss", loss, sync_dist=True)  # the mean over data ranks (RecordLosses reads it)
        return loss

    def validation_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = model_loss(self, self.model, inputs_of(data), data["labels"], causal_lm_loss)
        self.log("val/loss", loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.parameters(), lr=self.run.get("lr", 1e-3))

    def _loader(self, rows: list[dict[str, torch.Tensor]]) -> DataLoader:
        # each data rank its rows of every batch, in order (Lightning's own sampler would shuffle)
        sampler = DistributedSampler(rows, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(rows, batch_size=ROWS // sampler.num_replicas, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(samples(self.run["batches"], packed=self.run.get("packed", False)))

    def val_dataloader(self) -> DataLoader:
        return self._loader(samples(2, packed=self.run.get("packed", False)))


def gather_stages(params: dict[str, torch.Tensor], run: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Under pp each rank holds other layers: all of them (global names, so they merge)."""
    if run["dims"].get("pp", 1) == 1:
        return params
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, params)
    return {name: tensor for part in gathered for name, tensor in part.items()}


def router_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routers' selection biases by module name (none without ``selection_bias``)."""
    return {
        name: module.expert_bias.detach().clone()
        for name, module in model.named_modules()
        if getattr(module, "expert_bias", None) is not None
    }


def fit(run: dict[str, Any]) -> None:
    module = HFCausalLM(run)
    pipelined = run["dims"].get("pp", 1) > 1
    grad_norms, losses = RecordGradNorms(pipelined=pipelined), RecordLosses()
    callbacks: list[Callback] = [grad_norms, losses]
    if run.get("selection_bias"):  # the auxiliary-loss-free bias update after every optimizer step
        callbacks.append(ExpertLoadBalancing(run["selection_bias"]))
    if run.get("load_hf"):  # after the strategy's setup: streamed into the sharded parameters
        callbacks.insert(0, LoadHFWeights(run["load_hf"]))
    if run.get("export_hf"):  # at the end of training, as transformers' files (max_shard_size: several files)
        callbacks.append(ExportHF(run["export_hf"], filename="final", max_shard_size=40_000))
    if run.get("ckpt_dir"):  # training checkpoints mid-epoch, for a later run's resume_from
        callbacks.append(
            ModelCheckpoint(
                dirpath=run["ckpt_dir"],
                every_n_train_steps=run["save_every"],
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = L.Trainer(
        strategy=D9DStrategy(**run["dims"]),
        accelerator="cpu",
        devices=run["devices"],
        precision="32-true",
        max_steps=run["batches"] // run.get("accumulate", 1),
        accumulate_grad_batches=run.get("accumulate", 1),
        gradient_clip_val=run.get("clip"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(run.get("ckpt_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=run.get("resume_from"))
    params = gather_stages(full_parameters(module.model), run)
    result: dict[str, Any] = {
        "losses": losses.losses,
        "norms": grad_norms.norms,
        "params": params,
        "start": module.start,
        "biases": gather_stages(router_biases(module.model), run),
        "export_dir": run.get("export_hf"),
    }
    if run.get("validate"):
        trainer.limit_val_batches = 1.0
        result["val_loss"] = trainer.validate(module, verbose=False)[0]["val/loss"]
    meshes = {
        name
        for p in module.model.parameters()
        if isinstance(p, DTensor)
        for name in (p.device_mesh.mesh_dim_names or ())
    }
    result["meshes"] = sorted(meshes)
    modules = list(module.model.modules())
    result["compiled_layers"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
    result["checkpointed_layers"] = sum(hasattr(m, "_checkpoint_wrapped_module") for m in modules)
    result["layers_here"] = sorted(  # rank 0's decoder layers
        {int(name.split(".")[2]) for name, _ in module.model.named_parameters() if ".layers." in name}
    )
    if trainer.is_global_zero:
        torch.save(result, run["out"])


BATCHES = 6  # each run's batches (the tests' runs; a run may say otherwise)


def launch_parity_runs(runs: dict[str, dict[str, Any]], out: Path) -> dict[str, dict[str, Any]]:
    """Every run of ``runs`` (by name) in one launch of this script; what each rank 0 saved, by name."""
    listed = [{"batches": BATCHES, **run, "out": str(out / f"{name}.pt")} for name, run in runs.items()]
    subprocess.run([sys.executable, __file__, json.dumps(listed)], check=True, timeout=600)
    return {name: torch.load(out / f"{name}.pt") for name in runs}


def _one_copy(params: dict[str, torch.Tensor], names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` without the second copy of a tied weight whose stages sit on two pipeline ranks (each rank
    saves its own under its own name; the unmodified model names it once), after checking it equals the first."""
    kept = dict(params)
    if "lm_head.weight" in kept and "lm_head.weight" not in names:
        head = kept.pop("lm_head.weight")
        assert torch.equal(head, kept["model.embed_tokens.weight"]), "the tied copies drifted apart"
    return kept


def assert_matches_reference(run: dict[str, Any], got: dict[str, Any]) -> None:
    """``got`` (a run's results) against one process running the unmodified model on the same batches: the same
    start, losses, gradient norms before clipping, parameters after the last step and validation loss (1e-5)."""
    batches = run.get("batches", BATCHES)
    model = tiny_causal_lm(run["family"], layers=run["layers"], **run.get("model", {}))
    if run.get("meta"):
        model.load_state_dict(
            meta_initialised(run["family"], layers=run["layers"], **run.get("model", {})), strict=False
        )
    exclude_experts(model, run.get("exclude_experts", []))
    if run.get("selection_bias"):
        add_selection_bias(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = {**got, "start": _one_copy(got["start"], start), "params": _one_copy(got["params"], start)}
    assert set(got["start"]) == set(start)
    assert all(torch.equal(got["start"][n], p) for n, p in start.items())  # the same model to begin with
    expected = reference_run(
        model,
        batches,
        accumulate=run.get("accumulate", 1),
        clip=run.get("clip"),
        bias_rate=run.get("selection_bias"),
        packed=run.get("packed", False),
    )
    assert set(got["biases"]) == set(expected["biases"])
    for name, bias in expected["biases"].items():
        assert bias.any(), name  # the update moved it
        assert float((got["biases"][name] - bias).abs().max()) <= 1e-6, name
    if "clip" in run:  # clipping bit on some steps only
        assert min(expected["norms"]) < run["clip"] < max(expected["norms"])
    assert len(got["losses"]) == len(expected["losses"]) == batches
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(got["norms"], expected["norms"], strict=True)) <= 1e-5
    assert set(got["params"]) == set(expected["params"])
    for name, param in expected["params"].items():
        assert float((got["params"][name] - param).abs().max()) <= 1e-5, name
        # every parameter trained (an expert no token chooses only decays)
        assert not torch.equal(param, start[name]), name
    if run.get("validate"):
        assert abs(got["val_loss"] - expected["val_loss"]) <= 1e-5


def main(runs: list[dict[str, Any]]) -> None:
    trainer_runs.KINDS["hf_parity"] = fit
    for run in runs:  # each run's seconds to $TRAINER_SCRIPT_TIMES (trainer_script.timed)
        with timed(run), compile_backend(run.get("compile_backend")):
            trainer_runs.launch({**run, "kind": "hf_parity", "name": Path(run["out"]).stem}, timeout=300)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
