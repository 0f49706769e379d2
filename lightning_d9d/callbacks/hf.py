"""Hugging Face weights in and out of a training run: ``LoadHFWeights`` and ``ExportHF``.

Both work on any mesh and find the model inside the LightningModule: the submodule named by ``module_attr``, or
by default the one child module whose ``config`` has ``to_hf_dict()`` (our models) or that is a ``transformers``
model (whose own names and layout are its format: ``lightning_d9d.state.hf.transformers``). Our models' parameter
names must be those of the HF format's mapping (``lightning_d9d.state.hf``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_d9d.state import DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, SINGLE_FILE_NAME, parse_size
from lightning_d9d.state.hf import CONFIG_NAME, hf_side_files, load_hf, module_hf_config, save_hf
from lightning_d9d.state.hf.peft import ADAPTER_CONFIG, lora_layers, save_peft_adapter
from lightning_d9d.state.hf.transformers import is_transformers_module
from lightning_d9d.state.selection import looks_like_checkpoint
from lightning_d9d.state.training import HF_CONFIG_KEY

# What ExportHF writes of a LoRA-adapted model: the weights with the adapters merged in, the peft adapter
# directory, or both (the adapter in the export's ADAPTER_DIRECTORY)
LORA_EXPORTS = ("both", "merged", "adapter")
ADAPTER_DIRECTORY = "adapter"


def _pipelined(trainer: pl.Trainer) -> bool:
    """Whether each rank holds only its pipeline stage's part of the model (then loads and writes only that)."""
    try:
        # The d9d strategy's degrees; other strategies have none (and no pipeline).
        dims = getattr(trainer.strategy, "parallel_dims", None)
    except RuntimeError:  # not set up yet: no mesh, no pipeline
        return False
    return bool(getattr(dims, "pp", 1) > 1)


def find_hf_model(pl_module: pl.LightningModule, module_attr: str | None = None) -> tuple[str, nn.Module]:
    """The model inside ``pl_module`` that maps to a Hugging Face format, and its attribute path.

    ``module_attr`` names it (``"model"``, ``"backbone.lm"``; ``""`` for the LightningModule itself); by default
    it is the only direct child with a ``config.to_hf_dict()``.
    """
    if module_attr is not None:
        try:
            module = pl_module.get_submodule(module_attr)
        except AttributeError as error:
            raise AttributeError(
                f"{type(pl_module).__name__} has no submodule {module_attr!r} (module_attr): {error}"
            ) from error
        module_hf_config(module)  # fails early, with the reason, if it has no HF config
        return module_attr, module
    found = [
        (name, child)
        for name, child in pl_module.named_children()
        if callable(getattr(getattr(child, "config", None), "to_hf_dict", None))
        or is_transformers_module(child)
    ]
    if len(found) != 1:
        what = "none" if not found else ", ".join(repr(name) for name, _ in found)
        raise AttributeError(
            f"{type(pl_module).__name__}: cannot tell which submodule holds the model to load or export: "
            f"children with a config.to_hf_dict() or that are transformers models are {what}. Build the model (e.g. self.model = "
            "Qwen3ForCausalLM(...)) in __init__ or configure_model, or pass module_attr='...'"
        )
    return found[0]


# "owner/name", as the Hugging Face Hub names a model (Qwen/Qwen3-0.6B): a path of that form that is no local folder
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_DOWNLOAD = "hf download Qwen/Qwen3-0.6B --local-dir qwen3-0.6b"


def _listing(folder: Path, limit: int = 5) -> str:
    names = sorted(entry.name for entry in folder.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"it holds {', '.join(names[:limit])}{more}"


def _missing_folder(given: str, path: Path) -> str:
    if _HUB_ID.fullmatch(given):
        local = given.rpartition("/")[2].lower()
        return (
            f"LoadHFWeights({given!r}): no local folder {given} (relative to {Path.cwd()}). It looks like a "
            "Hugging Face Hub id, but LoadHFWeights reads a local folder and never downloads: download it first, "
            f"`hf download {given} --local-dir {local}`, then pass LoadHFWeights({local!r})"
        )
    return (
        f"LoadHFWeights({given!r}): the folder {path.absolute()} does not exist. Pass the local folder of a Hugging "
        f"Face model (config.json and *.safetensors); LoadHFWeights never downloads: `{_DOWNLOAD}`"
    )


def _check_hf_folder(path: str | os.PathLike[str], *, config_needed: bool = True) -> None:
    """Refuse ``path`` unless it is the local folder of a Hugging Face model: a directory holding ``config.json``
    (unless ``config_needed`` is false) and safetensors weights (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards). Cheap (names only, nothing read), so it runs where the
    callback is built, in every process, before any process group exists."""
    given, folder = os.fspath(path), Path(path)
    if not folder.exists():
        raise FileNotFoundError(_missing_folder(given, folder))
    if not folder.is_dir():
        parent = (
            f"; the folder holding it is {str(folder.parent)!r}"
            if folder.name == CONFIG_NAME or folder.suffix == ".safetensors"
            else ""
        )
        raise NotADirectoryError(
            f"LoadHFWeights({given!r}) is a file: pass the folder of a Hugging Face model (config.json and "
            f"*.safetensors){parent}"
        )
    if looks_like_checkpoint(folder):
        raise FileNotFoundError(
            f"LoadHFWeights({given!r}) is a training checkpoint, not a Hugging Face model folder (no {CONFIG_NAME}): "
            f"resume from it with trainer.fit(..., ckpt_path={given!r}), and pass LoadHFWeights the base model's folder"
        )
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"LoadHFWeights({given!r}) is a peft adapter ({ADAPTER_CONFIG}), not a model folder: pass the base "
            "model's folder (the model the adapter was trained on)"
        )
    if config_needed and not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"LoadHFWeights({given!r}): {folder} has no {CONFIG_NAME}, so it is not a Hugging Face model folder "
            f"({_listing(folder)}). Pass the folder holding {CONFIG_NAME} and the *.safetensors weights, e.g. a "
            f"download: `{_DOWNLOAD}`"
        )
    if not ((folder / INDEX_NAME).is_file() or (folder / SINGLE_FILE_NAME).is_file()):
        raise FileNotFoundError(
            f"LoadHFWeights({given!r}): {folder} holds no safetensors weights ({SINGLE_FILE_NAME}, or {INDEX_NAME} and "
            f"its shards; {_listing(folder)}). Only safetensors are read: save the model with transformers' "
            "save_pretrained (safetensors by default), or download the folder again"
        )


class LoadHFWeights(Callback):
    """Load a Hugging Face model folder into the model when fitting starts, on any mesh.

    ``path`` is a *local folder*: ``config.json`` and safetensors weights (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards), as ``save_pretrained`` writes them or
    ``hf download <owner/name> --local-dir <folder>`` (``huggingface-cli download`` before ``huggingface_hub`` 1.0)
    fetches them. Nothing is ever downloaded. A path that is no such folder (missing, a file, a Hub id such as ``Qwen/Qwen3-0.6B``, a folder without
    ``config.json`` or weights, a training checkpoint, a peft adapter) is refused when the callback is built,
    before any process starts, with the fix.

    The load happens once per ``fit``, at the first of ``on_sanity_check_start`` and ``on_train_start``: after
    the strategy has sharded, materialised and initialised the model (``configure_model`` → ``strategy.setup``),
    after Lightning has restored a checkpoint given as ``fit(ckpt_path=...)`` (the d9d strategy restores after
    ``on_fit_start``), and before any forward pass. The loaded values overwrite the initialisation in place, so
    the optimizer keeps its parameters. Each rank streams the files one group of tensors at a time and keeps only
    its own shards: no rank ever holds the whole model. Under pipeline parallelism each rank reads only the
    tensors of its stage.

    The directory's ``config.json`` must describe the model being trained (sizes, layer count, vocabulary, RoPE,
    ...); a checkpoint of another model fails with the differing fields named. Floating-point tensors are
    converted to the parameters' dtype (bf16 files into fp32 master weights).

    When the fit resumes from a checkpoint, nothing is loaded (the folder must still exist: leave the callback out
    to resume without it): the checkpoint's weights are the ones to continue from. Except under LoRA (``D9DStrategy(lora=...)``), whose
    checkpoints hold the adapters and not the frozen base: the strategy has the base loaded from the directory
    before it restores the checkpoint (:meth:`load_frozen_base`), and checks it is the base the adapters were
    trained on.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, module_attr: str | None = None, check_config: bool = True
    ) -> None:
        _check_hf_folder(path, config_needed=check_config)
        self.path = Path(path)
        self.module_attr = module_attr
        self.check_config = check_config
        self.hf_config: dict[str, Any] | None = None
        self.loaded = False  # in this fit

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(path=str(self.path))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only find the model (a wrong module_attr fails before anything runs) and note its config, which the
        # checkpoints of this run record. Loading waits: a checkpoint to resume from is not restored yet.
        self.hf_config = module_hf_config(find_hf_model(pl_module, self.module_attr)[1])
        self.loaded = False

    def load_frozen_base(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load the directory now, for a resume from a checkpoint that holds no frozen base (a LoRA run's): the
        d9d strategy calls it on every rank before it restores such a checkpoint, which then checks that the base
        is the one its adapters were trained on."""
        self.loaded = True
        name, model = find_hf_model(pl_module, self.module_attr)
        load_hf(model, self.path, self.hf_config, check_config=self.check_config, partial=_pipelined(trainer))
        rank_zero_info(
            f"LoadHFWeights: loaded the frozen base {self.path} into {type(pl_module).__name__}.{name}"
        )

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load_once(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load_once(trainer, pl_module)

    def _load_once(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loaded:
            return
        self.loaded = True
        if trainer.ckpt_path is not None:
            rank_zero_info(f"LoadHFWeights: resumed from {trainer.ckpt_path}, so {self.path} is not loaded")
            return
        name, model = find_hf_model(pl_module, self.module_attr)
        load_hf(model, self.path, self.hf_config, check_config=self.check_config, partial=_pipelined(trainer))
        rank_zero_info(f"LoadHFWeights: loaded {self.path} into {type(pl_module).__name__}.{name}")

    @override
    def state_dict(self) -> dict[str, Any]:
        # Recorded in training checkpoints, so that ``python -m lightning_d9d.convert dcp-to-hf`` finds the config.
        return {"source": str(self.path), HF_CONFIG_KEY: self.hf_config}


class ExportHF(Callback):
    """Write the model as a Hugging Face directory that ``transformers`` loads with ``from_pretrained``.

    Exports go to ``dirpath / filename.format(step=global_step, epoch=current_epoch)`` every
    ``every_n_train_steps`` optimizer steps and when training ends (unless that step was just exported); a
    ``filename`` without placeholders (``"latest"``) keeps replacing one export. Each export holds safetensors
    shards of at most
    ``max_shard_size`` (bytes, or ``"5GB"``), their index and ``config.json``, plus the non-weight files of
    ``copy_files_from`` (an HF directory: tokenizer, generation config; symbolic links are not copied).
    ``config.json`` names the model's own class in ``architectures`` (not the class FSDP wraps it in) and holds no
    field that makes ``transformers`` fetch or import code (``*_implementation``, ``auto_map``,
    ``quantization_config``). ``dtype`` casts floating-point weights (``torch.bfloat16`` halves the size; default:
    as trained).

    A model trained with LoRA (``D9DStrategy(lora=...)``): ``lora="both"`` (default) writes the weights with the
    adapters merged in and the ``peft`` adapter directory in the export's ``adapter/`` (``adapter_config.json``
    and ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, path)`` loads);
    ``"merged"`` the merged weights only; ``"adapter"`` the adapter directory only (at the export's path).
    ``base_model`` is recorded in ``adapter_config.json`` (the base model's folder or Hub name).

    Any mesh: every rank takes part (DTensors are gathered one group of tensors at a time) and rank 0 writes (under
    pipeline parallelism, the first rank of each stage writes that stage's tensors). A directory appears complete
    or not at all; an earlier export of the same name is replaced only then.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        on_train_end: bool = True,
        *,
        filename: str = "step={step}",
        dtype: torch.dtype | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
        copy_files_from: str | os.PathLike[str] | None = None,
        module_attr: str | None = None,
        lora: str = "both",
        base_model: str | os.PathLike[str] | None = None,
    ) -> None:
        if lora not in LORA_EXPORTS:
            raise ValueError(f"ExportHF(lora={lora!r}): choose one of {', '.join(map(repr, LORA_EXPORTS))}")
        self.lora = lora
        self.base_model = None if base_model is None else str(base_model)
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(
                f"every_n_train_steps ({every_n_train_steps}) must be a positive integer or None"
            )
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.export_on_train_end = on_train_end
        self.filename = filename
        self.dtype = dtype
        self.max_shard_bytes = parse_size(max_shard_size)
        self.copy_files_from = None if copy_files_from is None else Path(copy_files_from)
        self.module_attr = module_attr
        self.hf_config: dict[str, Any] | None = None
        self.last_step: int | None = None  # the step last exported (never twice)
        self.exported: list[Path] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath), filename=self.filename)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Fail before training, not at the first export, when the directory cannot be one.
        if self.copy_files_from is not None and not self.copy_files_from.is_dir():
            raise FileNotFoundError(
                f"ExportHF(copy_files_from={str(self.copy_files_from)!r}) is not a directory"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Known from the start, so that a training checkpoint saved before the first export records it too.
        self.hf_config = module_hf_config(find_hf_model(pl_module, self.module_attr)[1])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Called on every micro-batch; global_step only moves on optimizer steps, so this fires once per step.
        if self.every_n_train_steps and step > 0 and step % self.every_n_train_steps == 0:
            self.export(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.export_on_train_end:
            self.export(trainer, pl_module)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        """Export now (all ranks must call it); ``None`` if this step was already exported."""
        step = trainer.global_step
        if step == self.last_step:
            return None
        _, model = find_hf_model(pl_module, self.module_attr)
        self.hf_config = module_hf_config(model)
        extra = hf_side_files(self.copy_files_from) if self.copy_files_from is not None else None
        target = self.dirpath / self.filename.format(step=step, epoch=trainer.current_epoch)
        # every rank the same answer: under pp a stage may hold no adapter while another does
        adapted = trainer.strategy.reduce_boolean_decision(bool(lora_layers(model)), all=False)
        if adapted and self.lora == "adapter":
            path = self._write_adapter(trainer, model, target)
        else:
            path = save_hf(
                model,
                target,
                self.hf_config,
                dtype=self.dtype,
                max_shard_bytes=self.max_shard_bytes,
                extra_files=extra,
                partial=_pipelined(trainer),
            )
            if adapted and self.lora == "both":
                self._write_adapter(trainer, model, target / ADAPTER_DIRECTORY)
        self.last_step = step
        self.exported.append(path)
        rank_zero_info(f"ExportHF: step {step} written to {path}")
        return path

    def _write_adapter(self, trainer: pl.Trainer, model: nn.Module, target: Path) -> Path:
        return save_peft_adapter(
            model,
            target,
            base_model_name_or_path=self.base_model,
            dtype=self.dtype,
            partial=_pipelined(trainer),
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, HF_CONFIG_KEY: self.hf_config}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = state_dict.get("last_step")
