"""``convert dcp-to-hf`` of a LoRA run's checkpoint (the adapters, the frozen base's fingerprint and the LoRA
settings, not the base): ``--base <folder>`` merges the adapters into that base's weights, tensor for tensor what
``ExportHF(lora="merged")`` writes at the same step of the same run; ``--lora adapter`` writes what
``ExportHF(lora="adapter")`` writes; another base is refused naming a tensor, and no output appears.

Two fits on one process (``Trainer(strategy=D9DStrategy(lora=...))``, 3 steps each, in this process): our Qwen3
(every projection adapted) and our Qwen3-MoE with ``experts=True`` (per-expert adapters on its stacked experts,
exported through the HF layout that unstacks them). A checkpoint built by hand covers a base kept in bf16.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy, LoRA, model_loss
from lightning_d9d.callbacks import ExportHF, LoadHFWeights
from lightning_d9d.convert import main as convert_main
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans.lora import apply_lora
from lightning_d9d.state import CheckpointError, CheckpointReader
from lightning_d9d.state.frozen import (
    FINGERPRINT_KEY,
    LORA_KEY,
    fingerprint,
    frozen_names,
    lora_record,
    read_lora_record,
)
from lightning_d9d.state.hf import save_hf
from lightning_d9d.state.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lightning_d9d.state.training import optimizer_state, read_meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pretrain_qwen3 import SyntheticCorpus

STEPS = 3
VOCAB = Qwen3Config.tiny().vocab_size


class Tuned(L.LightningModule):
    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.build = build
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = self.build()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return model_loss(self, self.model, (batch["input_ids"],), batch["labels"], causal_lm_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


MODELS: dict[str, tuple[Callable[[], nn.Module], LoRA]] = {
    "qwen3": (lambda: Qwen3ForCausalLM(Qwen3Config.tiny()), LoRA(rank=4, alpha=8.0)),
    "moe_experts": (
        lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny()),
        LoRA(rank=2, alpha=4.0, targets=("q_proj", "o_proj"), experts=True),
    ),
}


def base_folder(path: Path, build: Callable[[], nn.Module], seed: int) -> Path:
    torch.manual_seed(seed)
    save_hf(build(), path)
    return path


def fit(tmp: Path, name: str) -> dict[str, Path]:
    """A LoRA fit of ``STEPS`` steps from a base folder: its checkpoint and ``ExportHF``'s export at the last step,
    and another base of the same model."""
    build, lora = MODELS[name]
    base, other = base_folder(tmp / "base", build, seed=1), base_folder(tmp / "other", build, seed=2)
    trainer = L.Trainer(
        strategy=D9DStrategy(lora=lora),
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LoadHFWeights(base),
            ModelCheckpoint(dirpath=tmp / "checkpoints", filename="last", every_n_train_steps=STEPS),
            ExportHF(tmp / "export", filename="final", base_model=base),
        ],
    )
    torch.manual_seed(0)
    trainer.fit(Tuned(build), DataLoader(SyntheticCorpus(VOCAB, 16, 32), batch_size=4))
    return {
        "ckpt": tmp / "checkpoints" / "last.ckpt",
        "export": tmp / "export" / "final",
        "base": base,
        "other": other,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Path]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {name: fit(tmp_path_factory.mktemp(name), name) for name in MODELS}
    yield found
    if dist.is_initialized():  # the fits' one-process group: later tests start without one
        dist.destroy_process_group()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {key: reader.read(key) for key in reader.weight_map}


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_checkpoint_records_the_lora_settings(runs: dict, name: str) -> None:
    _, lora = MODELS[name]
    record = read_meta(runs[name]["ckpt"], weights_only=True)[LORA_KEY]
    assert (record["rank"], record["alpha"], record["targets"], record["experts"]) == (
        lora.rank,
        lora.alpha,
        list(lora.targets),
        lora.experts,
    )
    assert record["base_dtype"] is None and set(record["frozen_dtypes"].values()) == {"float32"}
    # our GroupedExperts hold [E, in, out]: not out_first
    assert set(record["expert_layouts"].values()) == ({False} if lora.experts else set())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dcp_to_hf_with_base_merges_as_export_hf_does(runs: dict, name: str, tmp_path: Path) -> None:
    run = runs[name]
    merged = tmp_path / "merged"
    assert convert_main(["dcp-to-hf", str(run["ckpt"]), str(merged), "--base", str(run["base"])]) == 0
    expected = tensors(run["export"])
    assert_same_tensors(tensors(merged), expected)
    # the adapters trained: the merged weights are not the base's
    base = tensors(run["base"])
    assert any(not torch.equal(base[key], value) for key, value in expected.items())
    assert json.loads((merged / "config.json").read_text()) == json.loads(
        (run["export"] / "config.json").read_text()
    )

    adapter = tmp_path / "adapter"
    assert convert_main(["dcp-to-hf", str(run["ckpt"]), str(adapter), "--lora", "adapter"]) == 0
    exported = run["export"] / "adapter"
    assert_same_tensors(load_file(adapter / ADAPTER_WEIGHTS), load_file(exported / ADAPTER_WEIGHTS))
    assert json.loads((adapter / ADAPTER_CONFIG).read_text()) == json.loads(
        (exported / ADAPTER_CONFIG).read_text()
    )


def test_dcp_to_hf_refuses_another_base_by_name_and_a_merge_without_base(
    runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs["qwen3"]
    out = tmp_path / "out"
    assert convert_main(["dcp-to-hf", str(run["ckpt"]), str(out), "--base", str(run["other"])]) == 1
    error = capsys.readouterr().err
    assert re.search(
        rf"the base {re.escape(str(run['other']))}: \S+\.weight is not the base the adapters", error
    )
    assert f"pass --base the folder the run loaded its base from ({run['base']})" in error, error
    assert not out.exists()
    assert convert_main(["dcp-to-hf", str(run["ckpt"]), str(out)]) == 1
    error = capsys.readouterr().err
    assert "is a LoRA run's checkpoint" in error and "pass --base <the base model's folder>" in error, error
    assert not out.exists()


def test_a_base_kept_in_bf16_is_fingerprinted_and_merged_in_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``LoRA(base_dtype=torch.bfloat16)``: the fp32 base folder is cast to bf16 before its fingerprint is checked,
    and the merged weights are bf16, as ``save_hf`` (``ExportHF``'s writer) writes them from the model."""
    build, _ = MODELS["qwen3"]
    base = base_folder(tmp_path / "base", build, seed=1)
    model = build()
    model.load_state_dict(tensors(base))
    lora = LoRA(rank=4, alpha=8.0, base_dtype=torch.bfloat16)
    apply_lora(model, lora, seed=3)
    with torch.no_grad():  # B moved off zero, as training moves it
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
    frozen = frozen_names(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoint = {
        "state_dict": {k: v for k, v in model.state_dict().items() if k not in frozen},
        "optimizer_states": [optimizer_state(model, optimizer)],
        FINGERPRINT_KEY: fingerprint(model),
        LORA_KEY: lora_record(lora, model),
    }
    save(tmp_path / "lora.ckpt", checkpoint)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    merged = tmp_path / "merged"
    command = ["dcp-to-hf", str(tmp_path / "lora.ckpt"), str(merged), "--base", str(base)]
    assert convert_main([*command, "--config", str(tmp_path / "config" / "config.json")]) == 0
    save_hf(model, tmp_path / "export")
    got, expected = tensors(merged), tensors(tmp_path / "export")
    assert {value.dtype for value in got.values()} == {torch.bfloat16}
    assert_same_tensors(got, expected)
    # a LoRA checkpoint that records no settings (saved before they were recorded): refused, with the way out
    del checkpoint[LORA_KEY]
    save(tmp_path / "unrecorded.ckpt", checkpoint)
    command = ["dcp-to-hf", str(tmp_path / "unrecorded.ckpt"), str(tmp_path / "out"), "--base", str(base)]
    assert convert_main([*command, "--config", str(tmp_path / "config" / "config.json")]) == 1
    error = capsys.readouterr().err
    assert "records no LoRA settings" in error and "ExportHF" in error and not (tmp_path / "out").exists()


RECORD = {
    "rank": 4,
    "alpha": 8.0,
    "dropout": 0.0,
    "targets": ["q_proj"],
    "experts": False,
    "base_dtype": None,
    "frozen_dtypes": {"model.norm.weight": "float32"},
    "expert_layouts": {},
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", 0),
        ("alpha", "8"),
        ("dropout", 1.5),
        ("targets", "q_proj"),
        ("experts", 1),
        ("base_dtype", "int8"),
        ("frozen_dtypes", {"model.norm.weight": "object"}),
        ("expert_layouts", {"experts.w": "yes"}),
    ],
)
def test_a_crafted_lora_record_is_refused_naming_the_field(field: str, value: object) -> None:
    assert read_lora_record({LORA_KEY: RECORD}, "ckpt") is not None
    with pytest.raises(CheckpointError, match=rf"ckpt: meta.pt's 'lora' {field} is .*damaged or crafted"):
        read_lora_record({LORA_KEY: {**RECORD, field: value}}, "ckpt")
