"""Load a Hugging Face checkpoint into our module, and export our module as one, on any mesh.

``load_hf`` checks the directory's ``config.json`` against the module's config (another model is refused with
the differing fields named), then streams the weights group by group into the module's (possibly sharded)
parameters. ``save_hf`` gathers DTensors group by group and writes shards, index and ``config.json`` atomically
from rank 0 (under pipeline parallelism, from the first rank of each stage). Both are plain functions: the
Lightning callbacks in ``lightning_d9d.callbacks`` call them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compose import Parallel, Sequential, chain
from ..mapper import Cast, Drop, ModelStateMapper
from ..module_io import load_into_module, module_tensors, save_from_module
from ..reader import INDEX_NAME, CheckpointReader
from ..writer import DEFAULT_MAX_SHARD_BYTES
from .peft import adapter_keys, merge_mapper
from .registry import (
    CONFIG_NAME,
    HFConfig,
    HFFormat,
    check_same_model,
    hf_config_json,
    hf_dict,
    hf_format,
    read_hf_config,
)
from .transformers import is_transformers_module, transformers_format, transformers_hf_config

# Files of an HF directory that are weights (ours replace them) or that describe weights in another format.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Modelling code a folder may carry for transformers' trust_remote_code: an export names the built-in class and
# no auto_map, so the code would be inert there, and a handed folder's code is nothing to pass on.
_CODE_SUFFIXES = (".py", ".pyc", ".so")
#: The largest side file carried over (read whole into memory): tokenizers are tens of MiB.
MAX_SIDE_FILE_BYTES = 256 << 20
_WEIGHT_INDEXES = (INDEX_NAME, "pytorch_model.bin.index.json")

log = logging.getLogger(__name__)


def module_hf_config(module: nn.Module) -> dict[str, Any]:
    """The HF config of a model whose ``config`` has ``to_hf_dict()`` (our models), or of a ``transformers``
    model (its own config)."""
    if is_transformers_module(module):
        return transformers_hf_config(module)
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_hf_dict", None)):
        raise TypeError(
            f"{type(module).__name__} has no config.to_hf_dict() and is no transformers model: pass the Hugging "
            "Face config explicitly"
        )
    return hf_dict(config)


def module_hf_format(module: nn.Module, config: HFConfig) -> HFFormat:
    """The format between ``config``'s files and ``module``: the registered one of its family for our models,
    the module's own for a ``transformers`` model (:func:`~.transformers.transformers_format`)."""
    return transformers_format(module, config) if is_transformers_module(module) else hf_format(config)


def reading_mapper(
    fmt: HFFormat, config: HFConfig, keys: Collection[str], layout: str | None = None
) -> ModelStateMapper:
    """HF → module for a file with ``keys``: the format's mapping in the file's layout, plus a ``Drop`` of tied
    copies the file holds anyway (some tools write ``lm_head.weight`` for tied models)."""
    mapper = fmt.from_hf(config, layout if layout is not None else fmt.layout_of(keys))
    copies = [alias for alias in fmt.tied(config) if alias in keys and alias not in mapper.input_keys()]
    return Parallel([mapper, Drop(copies)]) if copies else mapper


def load_hf(
    module: nn.Module,
    directory: str | os.PathLike[str],
    config: HFConfig | Any | None = None,
    *,
    cast: bool = True,
    check_config: bool = True,
    layout: str | None = None,
    partial: bool = False,
) -> None:
    """Stream the HF checkpoint in ``directory`` into ``module`` (in place; DTensor parameters get their shards).

    ``config`` describes ``module`` (default: ``module.config.to_hf_dict()``). With ``check_config`` the
    directory's ``config.json`` must describe the same model (``ConfigMismatchError`` names the differing
    fields). With ``cast`` floating-point tensors are converted to the parameters' dtypes (bf16 files into fp32
    master weights). Every rank reads one group of full tensors at a time and keeps its shards. ``partial``: the
    module holds part of the model (a pipeline stage), and only its part is read.
    """
    expected = module_hf_config(module) if config is None else hf_dict(config)
    keys = CheckpointReader(directory).keys()
    fmt = module_hf_format(module, expected)
    if check_config:
        found = read_hf_config(directory)
        check_same_model(found, expected, path=str(Path(directory) / CONFIG_NAME), fmt=fmt)
    mapper = reading_mapper(fmt, expected, keys, layout)
    # LoRA's adapters are not in a base model's files: they keep their values (a fresh B is zero)
    leave = _beyond_format(fmt, module, mapper.output_keys()) | frozenset(adapter_keys(module))
    load_into_module(module, directory, mapper, cast=cast, partial=partial, leave=leave)


def writing_mapper(
    fmt: HFFormat, config: HFConfig, dtype: torch.dtype | None, layout: str | None = None
) -> ModelStateMapper:
    """Module → HF, then a cast of the floating-point tensors to ``dtype`` if given."""
    mapper: ModelStateMapper = fmt.to_hf(config, layout)
    if dtype is not None:
        mapper = chain(mapper, Cast(mapper.output_keys(), dtype, floating_only=True))
    return mapper


def hf_side_files(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """The files of an HF directory that are neither weights nor ``config.json`` (tokenizer, generation config,
    chat template, README), to carry over into a converted copy. Skipped, each with a log line: symbolic links (in a
    directory someone handed over, ``tokenizer.json`` may link to any file of this machine: a private key), code
    (``*.py``: remote modelling code), and files over :data:`MAX_SIDE_FILE_BYTES` (each is read whole)."""
    files: dict[str, bytes] = {}
    root = Path(directory).resolve()
    for path in sorted(Path(directory).iterdir()):
        name = path.name
        if (
            name.startswith(".")
            or name == CONFIG_NAME
            or name in _WEIGHT_INDEXES
            or name.endswith(_WEIGHT_SUFFIXES)
        ):
            continue
        if path.is_symlink() or path.resolve().parent != root:
            log.warning(
                "%s is a symbolic link: not copied (copy the file it links to by hand if it belongs)", path
            )
            continue
        if not path.is_file():
            continue
        if name.endswith(_CODE_SUFFIXES):
            log.warning("%s is code: not copied (the export names the model's built-in class)", path)
            continue
        size = path.stat().st_size
        if size > MAX_SIDE_FILE_BYTES:
            log.warning(
                "%s holds %d bytes, more than a side file's %d: not copied (copy it by hand if it belongs)",
                path,
                size,
                MAX_SIDE_FILE_BYTES,
            )
            continue
        files[name] = path.read_bytes()
    return files


def _floating_dtype(module: nn.Module) -> torch.dtype | None:
    tensors, _ = module_tensors(module)
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), None)


def save_hf(
    module: nn.Module,
    directory: str | os.PathLike[str],
    config: HFConfig | Any | None = None,
    *,
    dtype: torch.dtype | None = None,
    layout: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, bytes | str] | None = None,
    partial: bool = False,
) -> Path:
    """Write ``module`` as an HF checkpoint directory (shards, index, ``config.json``) that ``transformers``
    loads with ``from_pretrained``; LoRA's adapters merged into their weights (``peft.save_peft_adapter``
    writes them on their own).

    A collective in a multi-rank run: every rank calls it, DTensors are gathered group by group, rank 0 writes,
    and the directory appears complete or not at all (an existing export there is replaced only then).
    ``config`` describes ``module`` (default: ``module.config.to_hf_dict()``); ``dtype`` casts floating-point
    tensors (default: as they are). ``extra_files`` (name → content: tokenizer files, see ``hf_side_files``) go
    into the same directory. ``partial``: each rank's module holds part of the model (pipeline stages); each part
    is written by the lowest rank holding it, into the one directory.
    """
    hf = module_hf_config(module) if config is None else hf_dict(config)
    fmt = module_hf_format(module, hf)
    written_dtype = dtype if dtype is not None else _floating_dtype(module)
    files = {**(extra_files or {}), CONFIG_NAME: hf_config_json(hf, dtype=written_dtype)}
    mapper = writing_mapper(fmt, hf, dtype, layout)
    merge = merge_mapper(module)
    if merge is not None:  # LoRA's adapters folded into their weights: a model transformers loads as it is
        mapper = Sequential([merge, mapper])
    return save_from_module(
        module,
        directory,
        mapper,
        max_shard_bytes=max_shard_bytes,
        extra_files=files,
        partial=partial,
        leave=_beyond_format(fmt, module, mapper.input_keys()),
    )


def _beyond_format(fmt: HFFormat, module: nn.Module, covered: Collection[str]) -> frozenset[str]:
    """The keys of a ``transformers`` model that its class does not build, so its format (built from the class)
    does not cover them: state our code added, such as a router's selection bias
    (:mod:`lightning_d9d.models.hf.routing`). ``ExportHF`` leaves them out, ``LoadHFWeights`` leaves them as
    they are; the training checkpoint keeps them. For our own models every key must be covered: none."""
    if not fmt.from_transformers:
        return frozenset()
    tensors, _ = module_tensors(module)
    return frozenset(tensors) - frozenset(covered)
