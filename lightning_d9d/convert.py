"""Convert checkpoints on any machine, without GPUs or a process group: ``python -m lightning_d9d.convert``.

Every conversion streams: one group of tensors is read, mapped and queued for the current output shard at a
time, so memory stays near a few of the largest tensors plus one shard, whatever the size of the model. Every
check that needs no data (keys, shapes, config) runs before the first tensor is read, and the output directory
appears complete or not at all. ``dcp-to-hf`` first checks every file of the checkpoint against its
``manifest.json`` (sizes and CRC-32s, as a resume does), and refuses a checkpoint without one unless given
``--no-verify``. A LoRA run's checkpoint holds the adapters and not the frozen base: ``dcp-to-hf --base <folder>``
streams the base from its Hugging Face folder, checks it against the fingerprint the checkpoint records, and writes
the weights with the adapters merged in (``--lora adapter``: the ``peft`` adapter directory instead, which needs no
base); without ``--base`` a merge is refused (``state/hf/lora_checkpoint.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_d9d.state import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    CheckpointReader,
    ConfigMismatchError,
    DCPReader,
    GroupResult,
    KeyCoverageError,
    ReadPlan,
    Sequential,
    ShapeMismatchError,
    ShardedWriter,
    infer_shapes,
    manifest,
    parse_size,
)
from lightning_d9d.state.errors import MissingShardError, format_keys
from lightning_d9d.state.frozen import FINGERPRINT_KEY
from lightning_d9d.state.hf import (
    CONFIG_NAME,
    HFFormat,
    check_expert_count,
    check_layer_count,
    check_same_model,
    code_fields,
    hf_config_json,
    hf_format,
    hf_formats,
    hf_side_files,
    read_hf_config,
    reading_mapper,
    transformers_model_format,
    writing_mapper,
)
from lightning_d9d.state.hf.lora_checkpoint import (
    adapter_export,
    base_merge,
    read_lora_meta,
    recorded_base,
    recorded_lora,
    under_prefix,
)
from lightning_d9d.state.hf.peft import ADAPTER_WEIGHTS
from lightning_d9d.state.training import (
    DCP_METADATA_NAME,
    META_NAME,
    MODEL_SECTION,
    read_meta,
    recorded_hf_config,
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# safetensors' names of the dtypes a config.json states
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}


# ------------------------------------------------------------------------------------------------ helpers
def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None where there is no such file: not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_now() -> int | None:
    return _status_bytes("VmRSS")


def _reset_peak_rss() -> None:
    """Start the high-water mark afresh, so that the peak ``--stats`` reports is the conversion's own."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS to the current RSS (Linux only, best effort)
    except OSError:
        pass


def _peak_rss() -> int | None:
    # VmHWM, not getrusage's ru_maxrss: ru_maxrss also counts the RSS of the process that launched this one, as it
    # was when it forked (a test runner holding 1.5 GiB reports a 1.5 GiB peak here, whatever the conversion does).
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, kilobytes on Linux


def _check_model_type(fmt: HFFormat, model: str | None, config_path: str) -> None:
    if model is not None and hf_format(model) is not fmt:
        raise ConfigMismatchError(
            f"{config_path} describes another model: model_type {fmt.model_type!r}, not {model!r} (--model)",
            path=config_path,
            fields={"model_type": (fmt.model_type, model)},
        )


def _check_shapes(
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    where: Callable[[str], str],
    config: str,
) -> None:
    """Every tensor has the shape the config implies; the first few that do not are named, with their file."""
    wrong = [key for key in sorted(expected) if key in found and tuple(found[key]) != tuple(expected[key])]
    if wrong:
        lines = "\n".join(
            f"  {key!r} in {where(key)}: shape {tuple(found[key])}, the config implies {tuple(expected[key])}"
            for key in wrong[:5]
        )
        more = f"\n  ... and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise ShapeMismatchError(
            f"{len(wrong)} tensors do not match {config} (a checkpoint of another model?):\n{lines}{more}",
            key=wrong[0],
        )


def detect_prefix(keys: Collection[str], expected: Collection[str], checkpoint: str) -> str:
    """The prefix under which ``checkpoint`` holds every key of the model (``"model."`` for a LightningModule
    whose model is ``self.model``)."""
    present = set(keys)
    anchor = min(expected)
    candidates = sorted({key[: -len(anchor)] for key in present if key.endswith(anchor)}, key=len)
    complete = [prefix for prefix in candidates if all(prefix + key in present for key in expected)]
    if len(complete) == 1:
        return complete[0]
    if complete:
        raise CheckpointError(
            f"{checkpoint} holds the model under several prefixes ({', '.join(map(repr, complete))}): "
            "choose one with --prefix"
        )
    if candidates:
        best = min(candidates, key=lambda prefix: sum(prefix + key not in present for key in expected))
        missing = [key for key in expected if best + key not in present]
        raise KeyCoverageError(
            f"{checkpoint} does not hold the model the config describes: under prefix {best!r} "
            f"{len(missing)} keys are missing: {format_keys(missing)}",
            missing_source=[best + key for key in missing],
        )
    raise KeyCoverageError(
        f"{checkpoint} does not hold the model the config describes: no key ends with {anchor!r}; it holds "
        f"{format_keys(present, limit=5)}. Check --config, or give --prefix",
        missing_source=[anchor],
    )


def _refuse_merge_without_base(checkpoint: Path, meta: dict[str, Any]) -> None:
    """A LoRA run's checkpoint holds the adapters and a fingerprint of the frozen base, not the base: no model folder
    can be written from it alone. Refused first, naming what is missing and the option that supplies it."""
    fingerprint = meta[FINGERPRINT_KEY]
    count = (
        f"{len(fingerprint)} tensors: {format_keys(fingerprint, limit=3)}"
        if isinstance(fingerprint, dict)
        else ""
    )
    base = recorded_base(meta)
    where = f"; its base was loaded from {base}" if base is not None else ""
    raise CheckpointError(
        f"{checkpoint} is a LoRA run's checkpoint: it holds the adapters and a fingerprint of the frozen base, not "
        f"the base its adapters were trained on ({count}{where}), so dcp-to-hf needs that base to merge them into: "
        "pass --base <the base model's folder> (checked against the fingerprint), or --lora adapter for the peft "
        "adapter alone. While a run trains, ExportHF(dirpath, lora='merged' | 'adapter' | 'both') "
        "(lightning_d9d.callbacks) exports the same"
    )


def _config_from_meta(checkpoint: Path) -> dict[str, Any] | None:
    """The HF config recorded in the checkpoint: by ``LoadHFWeights`` / ``ExportHF`` in their callback states, or
    by the strategy at save time (:func:`~lightning_d9d.state.training.recorded_hf_config`)."""
    try:
        meta = read_meta(checkpoint, weights_only=True, map_location="cpu")
    except CheckpointError:  # missing, or a custom object in the hyper-parameters: then --config is needed
        return None
    return recorded_hf_config(meta)


class _Progress:
    """Counts what went through, and reports it (``--stats`` adds a JSON line with the memory numbers)."""

    def __init__(self, command: str, output: Path, plan: ReadPlan) -> None:
        self.command, self.output, self.plan = command, output, plan
        _reset_peak_rss()
        self.rss_before = _rss_now()
        self.start = time.perf_counter()
        self.tensors = self.bytes_written = 0

    def written(self, outputs: dict[str, torch.Tensor]) -> None:
        self.tensors += len(outputs)
        self.bytes_written += sum(tensor.nbytes for tensor in outputs.values())

    def report(self, writer: ShardedWriter, stats: bool) -> None:
        seconds = time.perf_counter() - self.start
        files = sorted(path.name for path in self.output.iterdir() if path.suffix == ".safetensors")
        print(
            f"{self.command}: {self.tensors} tensors, {self.bytes_written / 2**30:.2f} GiB in {len(files)} "
            f"files -> {self.output} ({seconds:.1f} s)"
        )
        if stats:
            record = {
                "command": self.command,
                "output": str(self.output),
                "seconds": round(seconds, 3),
                "groups": len(self.plan.groups),
                "tensors": self.tensors,
                "bytes_read": self.plan.total_bytes,
                "bytes_written": self.bytes_written,
                "largest_group_bytes": self.plan.largest_group_bytes,
                "max_shard_bytes": writer.max_shard_bytes,
                "shards": len(files),
                "rss_before_bytes": self.rss_before,
                "peak_rss_bytes": _peak_rss(),
            }
            print(json.dumps(record))


def _write(
    results: Iterator[GroupResult],
    writer: ShardedWriter,
    progress: _Progress,
    expected: dict[str, tuple[int, ...]] | None,
    config_path: str,
) -> None:
    with writer:
        for result in results:
            if expected is not None:
                found = {key: tuple(value.shape) for key, value in result.outputs.items()}
                origin = result.origin()
                _check_shapes(found, expected, lambda key: origin, config_path)  # noqa: B023 (called right here)
            for key, value in result.outputs.items():
                writer.add(key, value)
            progress.written(result.outputs)
            del result  # free this group before the next one is read


def verify_checkpoint(checkpoint: Path) -> None:
    """Every file of ``checkpoint`` has the size and CRC-32s its ``manifest.json`` lists (the checks of a resume),
    before anything else of it is read; a checkpoint without a manifest is refused, since nothing says its files
    are whole. Errors name the file and the reason (``MissingShardError``, ``CorruptShardError``,
    ``CorruptIndexError``)."""
    if not (checkpoint / manifest.MANIFEST_NAME).is_file():
        if not (checkpoint / DCP_METADATA_NAME).is_file():
            return  # no directory, or not a checkpoint at all: DCPReader, called next, says which
        raise MissingShardError(
            f"{checkpoint} has no {manifest.MANIFEST_NAME}, so its files cannot be verified (sizes and CRC-32s): "
            "it was written by something other than D9DStrategy (Trainer(strategy='d9d')), or its save did not "
            "finish. Choose another checkpoint, or pass --no-verify to convert it anyway, unverified",
            path=str(checkpoint / manifest.MANIFEST_NAME),
        )
    manifest.verify(checkpoint)


# ---------------------------------------------------------------------------------------------- commands
def _check_module_shapes(
    reader: DCPReader,
    fmt: HFFormat,
    config: dict[str, Any],
    layout: str | None,
    checkpoint: str,
    config_path: str,
) -> None:
    """Every tensor of the checkpoint (``reader`` at its prefix) has the shape ``fmt``'s module implies."""
    if fmt.hf_shapes is None:
        return
    chosen = fmt.resolve_layout(layout)
    module_shapes = infer_shapes(fmt.from_hf(config, chosen), fmt.hf_shapes(config, chosen))
    _check_shapes(
        reader.shapes(), module_shapes, lambda key: f"{checkpoint} (as {reader.prefix + key!r})", config_path
    )


def _format_of_checkpoint(
    reader: DCPReader,
    config: dict[str, Any],
    args: argparse.Namespace,
    checkpoint: str,
    config_path: str,
    frozen_keys: Collection[str] = (),
) -> tuple[HFFormat, Any, str]:
    """The format whose module keys and shapes the checkpoint holds, its writing mapper and the keys' prefix:
    ours for the config's model type where it has one (our white-box model's checkpoint), else the
    ``transformers`` class the config names, built on ``meta`` (a ``transformers`` model trained under the strategy
    keeps its class's names and layout: Qwen3-MoE's fused experts, any family without a format of ours). The
    shapes decide where the names agree: our experts' ``gate_up_proj`` is transformers' transposed. ``frozen_keys``:
    the model keys a LoRA checkpoint left out (its fingerprint's), which count as held when the prefix is found."""
    dtype = DTYPES[args.dtype] if args.dtype else None
    unknown: list[CheckpointError] = []  # no such format
    failures: list[CheckpointError] = []  # a format that does not fit the checkpoint
    builds: tuple[Callable[[dict[str, Any]], HFFormat], ...] = (
        hf_format,
        lambda config: transformers_model_format(config, config_path),
    )
    for build in builds:
        try:
            fmt = build(config)
        except CheckpointError as failure:
            unknown.append(failure)
            continue
        try:
            mapper = writing_mapper(fmt, config, dtype, args.layout)
            prefix = args.prefix
            if prefix is None:
                prefix = detect_prefix(reader.all_keys() | set(frozen_keys), mapper.input_keys(), checkpoint)
            _check_module_shapes(
                reader.with_prefix(prefix), fmt, config, args.layout, checkpoint, config_path
            )
            return fmt, mapper, prefix
        except CheckpointError as failure:
            failures.append(failure)
    # why the format that fits best does not fit, else why the last lookup (the transformers class) failed
    raise failures[0] if failures else unknown[-1]


def _refuse_output_at(output: Path, directory: Path, command: str, why: str, *, inside: bool = True) -> None:
    """``output`` may not be ``directory`` (nor, with ``inside``, in it); paths resolved, so that links and
    ``..`` do not hide it."""
    resolved, target = directory.resolve(), output.resolve()
    if target == resolved or (inside and resolved in target.parents):
        where = "is inside" if inside else "is"
        raise CheckpointError(f"{command}: the output {output} {where} {resolved}, {why}: write elsewhere")


def _refuse_layers_beyond_config(
    beyond: Collection[str], built: Collection[str], checkpoint: str, config_path: str
) -> None:
    """Keys the class does not build are left out only where they are state our code added (a router's selection
    bias): a key the class builds at another layer number is a layer the config does not have."""

    def numbered(key: str) -> str:
        return ".".join("#" if part.isdigit() else part for part in key.split("."))

    patterns = {numbered(key) for key in built}
    layers = [key for key in beyond if numbered(key) in patterns]
    if layers:
        raise KeyCoverageError(
            f"{checkpoint} holds {len(layers)} tensors of layers the config does not have ({config_path} has "
            f"fewer layers; a config of another model?): {format_keys(layers)}",
            unexpected_source=layers,
        )


def _checkpoint_config(
    args: argparse.Namespace, checkpoint: Path, side_from: Path | None = None
) -> tuple[dict[str, Any], str, dict[str, bytes]]:
    """The checkpoint's Hugging Face config (``--config``, else the one recorded in it), where it was read, and the
    non-weight files to copy beside the weights (``--config``'s directory's, else ``side_from``'s)."""
    side: dict[str, bytes] = hf_side_files(side_from) if side_from is not None else {}
    if args.config is not None:
        config = read_hf_config(args.config)
        config_path = str(Path(args.config) / CONFIG_NAME if Path(args.config).is_dir() else args.config)
        if Path(args.config).is_dir():
            side = hf_side_files(args.config)
    else:
        found = _config_from_meta(checkpoint)
        if found is None:
            raise CheckpointError(
                f"{checkpoint} records no Hugging Face config (the strategy records the model's where it has one, "
                "LoadHFWeights and ExportHF theirs): pass --config with the model's config.json or its Hugging "
                "Face directory"
            )
        config, config_path = found, f"the config recorded in {checkpoint / META_NAME}"
    left_out = code_fields(config)
    if left_out:
        print(
            f"dcp-to-hf: left out of config.json, as fields that make transformers fetch or import code: {left_out}"
        )
    return config, config_path, side


def _check_hf_folder(
    reader: CheckpointReader, fmt: HFFormat, config: dict[str, Any], config_path: str, source: str
) -> None:
    """A Hugging Face folder's weights have the layer count and the shapes ``config`` implies."""
    check_layer_count(config, reader.keys(), config_path=config_path, source=source)
    info = reader.tensor_info()
    found = {key: value.shape for key, value in info.items()}
    check_expert_count(config, found, config_path=config_path, source=source)
    if fmt.hf_shapes is not None:
        layout = fmt.layout_of(reader.keys())
        hf_shapes = fmt.hf_shapes(config, layout)
        _check_shapes(found, hf_shapes, lambda key: str(reader.directory / info[key].file), config_path)


def _beyond_class(
    fmt: HFFormat, keys: Collection[str], read: Collection[str], checkpoint: Path, config_path: str
) -> set[str]:
    """Of a ``transformers`` model's checkpoint ``keys``, those its class does not build (a router's selection
    bias: not HF state), which the mapper does not ``read``; layers beyond the config are refused."""
    if not fmt.from_transformers:
        return set()
    beyond = sorted(set(keys) - set(read))
    _refuse_layers_beyond_config(beyond, read, str(checkpoint), config_path)
    if beyond:
        print(f"dcp-to-hf: left out {len(beyond)} tensors transformers' class has no field for: {beyond[:3]}")
    return set(beyond)


def dcp_to_hf(args: argparse.Namespace) -> None:
    checkpoint = Path(args.checkpoint)
    output = Path(args.output).absolute()
    # the directory a config is read from: replacing it would lose what the export does not carry
    if args.config is not None:
        given = Path(args.config)
        why = (
            "the directory --config is read from (it would be replaced, with files the export does not carry)"
        )
        if given.is_dir():
            _refuse_output_at(output, given, "dcp-to-hf", why)
        else:
            _refuse_output_at(output, given.parent, "dcp-to-hf", why, inside=False)
    lora = read_lora_meta(checkpoint)
    if lora is not None:
        _lora_to_hf(args, checkpoint, output, lora)
        return
    if args.base is not None or args.lora is not None:
        option = "--base" if args.base is not None else "--lora"
        raise CheckpointError(
            f"{option} is for a LoRA run's checkpoint, and {checkpoint} is none (it holds every weight and no base "
            f"fingerprint): leave {option} out"
        )
    if args.verify:
        verify_checkpoint(checkpoint)
    reader = DCPReader(checkpoint, section=MODEL_SECTION)
    config, config_path, side = _checkpoint_config(args, checkpoint)
    check_layer_count(config, reader.all_keys(), config_path=config_path, source=f"checkpoint {checkpoint}")
    check_expert_count(config, reader.shapes(), config_path=config_path, source=f"checkpoint {checkpoint}")
    dtype = DTYPES[args.dtype] if args.dtype else None
    fmt, mapper, prefix = _format_of_checkpoint(reader, config, args, str(checkpoint), config_path)
    _check_model_type(fmt, args.model, config_path)
    aliases = set(fmt.tied(config))
    reader = reader.with_prefix(prefix)
    ignore = aliases & reader.keys()  # a tied head is saved under both names; read it once
    # keys the class does not build (a router's selection bias): not HF state
    ignore |= _beyond_class(fmt, reader.keys() - aliases, mapper.input_keys(), checkpoint, config_path)
    plan = reader.plan(mapper, ignore=ignore)
    written = dtype if dtype is not None else next(iter(reader.dtypes().values()), None)
    extra: dict[str, bytes | str] = {**side, CONFIG_NAME: hf_config_json(config, dtype=written)}
    writer = ShardedWriter(output, max_shard_bytes=args.max_shard_size, extra_files=extra)
    progress = _Progress("dcp-to-hf", output, plan)
    expected = fmt.hf_shapes(config, fmt.resolve_layout(args.layout)) if fmt.hf_shapes is not None else None
    _write(reader.stream(mapper, ignore=ignore), writer, progress, expected, config_path)
    progress.report(writer, args.stats)


def _lora_to_hf(args: argparse.Namespace, checkpoint: Path, output: Path, meta: dict[str, Any]) -> None:
    """A LoRA run's checkpoint: merged into the ``--base`` folder's weights (checked against the recorded
    fingerprint), or, with ``--lora adapter``, the peft adapter directory (``state/hf/lora_checkpoint.py``)."""
    if args.base is None and args.lora != "adapter":
        _refuse_merge_without_base(checkpoint, meta)
    fingerprint, record = recorded_lora(meta, str(checkpoint))
    base = None if args.base is None or args.lora == "adapter" else Path(args.base)  # read for a merge only
    if base is not None:
        _refuse_output_at(output, base, "dcp-to-hf", "the --base folder (it would be replaced)")
        base_reader = CheckpointReader(base)  # a folder without safetensors weights is refused here
    if args.verify:
        verify_checkpoint(checkpoint)
    reader = DCPReader(checkpoint, section=MODEL_SECTION)
    config, config_path, side = _checkpoint_config(args, checkpoint, side_from=base)
    fmt, _, prefix = _format_of_checkpoint(
        reader, config, args, str(checkpoint), config_path, frozen_keys=fingerprint.keys()
    )
    _check_model_type(fmt, args.model, config_path)
    reader = reader.with_prefix(prefix)
    fingerprint, record = under_prefix(prefix, fingerprint, record)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if base is None:  # --lora adapter
        base_name = args.base if args.base is not None else recorded_base(meta)
        adapter = adapter_export(reader, record, base_name=base_name, dtype=dtype, source=str(checkpoint))
        plan = reader.plan(adapter.mapper, ignore=adapter.ignore)
        writer = ShardedWriter(output, extra_files=adapter.files, single_file=ADAPTER_WEIGHTS)
        progress = _Progress("dcp-to-hf", output, plan)
        _write(reader.stream(adapter.mapper, ignore=adapter.ignore), writer, progress, None, str(checkpoint))
        progress.report(writer, args.stats)
        return
    check_same_model(
        read_hf_config(base),
        config,
        path=str(base / CONFIG_NAME),
        expected_name="the checkpoint's model",
        fmt=fmt,
    )
    _check_hf_folder(base_reader, fmt, config, config_path, source=f"the base {base}")
    recorded = recorded_base(meta)
    fix = (
        "pass --base the folder the run loaded its base from"
        + (f" ({recorded})" if recorded is not None else "")
        + ", holding the weights it held then"
    )
    merge = base_merge(
        base_reader,
        reader,
        fmt,
        config,
        fingerprint=fingerprint,
        record=record,
        dtype=dtype,
        layout=args.layout,
        where=f"the base {base}",
        fix=fix,
    )
    ignore = merge.aliases | _beyond_class(
        fmt, merge.trained, merge.mapper.input_keys(), checkpoint, config_path
    )
    plan = merge.reader.plan(merge.mapper, ignore=ignore)
    extra: dict[str, bytes | str] = {**side, CONFIG_NAME: hf_config_json(config, dtype=merge.dtype)}
    writer = ShardedWriter(output, max_shard_bytes=args.max_shard_size, extra_files=extra)
    progress = _Progress("dcp-to-hf", output, plan)
    expected = fmt.hf_shapes(config, fmt.resolve_layout(args.layout)) if fmt.hf_shapes is not None else None
    _write(merge.reader.stream(merge.mapper, ignore=ignore), writer, progress, expected, config_path)
    progress.report(writer, args.stats)


def hf_to_hf(args: argparse.Namespace) -> None:
    source = Path(args.source)
    output = Path(args.output).absolute()
    _refuse_output_at(output, source, "hf-to-hf", "the source (it would be replaced)")
    config = read_hf_config(source)
    config_path = str(source / CONFIG_NAME)
    fmt = hf_format(config)
    _check_model_type(fmt, args.model, config_path)
    reader = CheckpointReader(source)
    keys = reader.keys()
    _check_hf_folder(reader, fmt, config, config_path, source=str(source))
    layout_in = fmt.layout_of(keys)
    dtype = DTYPES[args.dtype] if args.dtype else None
    mapper = Sequential(
        [reading_mapper(fmt, config, keys, layout_in), writing_mapper(fmt, config, dtype, args.layout)]
    )
    plan = reader.plan(mapper)
    written = dtype
    if written is None:
        first = next(iter(reader.tensor_info().values()), None)
        written = _SAFETENSORS_DTYPES.get(first.dtype) if first is not None else None
    extra: dict[str, bytes | str] = {
        **hf_side_files(source),
        CONFIG_NAME: hf_config_json(config, dtype=written),
    }
    writer = ShardedWriter(output, max_shard_bytes=args.max_shard_size, extra_files=extra)
    progress = _Progress("hf-to-hf", output, plan)
    _write(reader.stream(mapper), writer, progress, None, config_path)
    progress.report(writer, args.stats)


# ------------------------------------------------------------------------------------------- command line
DESCRIPTION = """\
Convert model checkpoints without GPUs or a process group, streaming: memory stays near a few of the largest
tensors plus one output shard, whatever the size of the model. Keys, shapes and the config are checked before
the first tensor is read; the output directory appears complete or not at all. A config's fields that make
transformers fetch or import code (*_implementation, auto_map, quantization_config) are neither used nor written.

commands:
  dcp-to-hf   a training checkpoint written by Trainer(strategy="d9d") (a directory with .metadata, *.distcp and
              meta.pt; any mesh) -> a Hugging Face directory (safetensors shards, index, config.json) that
              transformers loads with from_pretrained. A LoRA run's checkpoint (the adapters without the frozen
              base) needs --base <the base model's folder> to merge them into, checked against the base's
              fingerprint the checkpoint records; --lora adapter writes the peft adapter directory instead
  hf-to-hf    a Hugging Face directory -> another one: re-shard (--max-shard-size), cast (--dtype), or change
              the file layout where a model family has several (--layout); every key and shape is checked
              against config.json on the way, and tokenizer and other non-weight files are copied

There is no hf-to-dcp: a training checkpoint also holds optimizer and loop state, which an HF directory does
not have, so Trainer.fit(ckpt_path=...) could not resume from it. To start training from Hugging Face weights,
add the LoadHFWeights callback (lightning_d9d.callbacks), which streams them into the sharded model at fit start;
ExportHF writes Hugging Face directories during and after training.
"""

EPILOG = """\
examples:
  python -m lightning_d9d.convert dcp-to-hf runs/ckpt/step=1000.ckpt exports/step1000 --config ~/models/Qwen3-0.6B
  python -m lightning_d9d.convert dcp-to-hf runs/lora/last.ckpt exports/merged --base ~/models/Qwen3-0.6B
  python -m lightning_d9d.convert hf-to-hf Qwen3-8B Qwen3-8B-bf16 --dtype bfloat16 --max-shard-size 2GB

models: {models}
"""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        metavar="DTYPE",
        help="cast floating-point tensors to float32, bfloat16 or float16 (also: fp32, bf16, fp16); default: "
        "keep the checkpoint's",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="largest output shard, e.g. 5GB (default), 500MB, 2GiB; one shard is written as model.safetensors",
    )
    parser.add_argument(
        "--model",
        metavar="TYPE",
        help="the model_type expected (e.g. qwen3); a checkpoint of another model is refused. Default: the "
        "config's model_type",
    )
    parser.add_argument(
        "--layout",
        help="the file layout to write, for model families with several (default: the current one)",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print a last line of JSON: seconds, bytes, largest group, shard size, RSS before converting and "
        "peak RSS since then (VmHWM)",
    )


def build_parser() -> argparse.ArgumentParser:
    models = ", ".join(
        f"{name} ({', '.join(fmt.architectures)})" for name, fmt in sorted(hf_formats().items())
    )
    parser = argparse.ArgumentParser(
        prog="python -m lightning_d9d.convert",
        description=DESCRIPTION,
        epilog=EPILOG.format(models=models),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="dcp-to-hf or hf-to-hf (see above); COMMAND --help lists its options",
    )

    dcp = commands.add_parser(
        "dcp-to-hf",
        description="Convert a training checkpoint of Trainer(strategy='d9d') (written on any mesh) to a "
        "Hugging Face directory. First checks every file against the checkpoint's manifest.json (sizes and "
        "CRC-32s), then reads only the model tensors (not the optimizer state), one group at a time.",
    )
    dcp.add_argument(
        "checkpoint", help=f"the checkpoint directory (holds {DCP_METADATA_NAME}, *.distcp, {META_NAME})"
    )
    dcp.add_argument(
        "output",
        help="the Hugging Face directory to write (replaced only once complete; not the --config directory)",
    )
    dcp.add_argument(
        "--config",
        metavar="PATH",
        help="the model's config.json, or a Hugging Face directory holding one (its tokenizer and other "
        "non-weight files are copied too, symbolic links and code not). Default: the config recorded in the "
        "checkpoint (by the strategy for a model with one, or by LoadHFWeights or ExportHF)",
    )
    dcp.add_argument(
        "--prefix",
        help="where the model sits in the LightningModule's state dict, e.g. 'model.' for self.model "
        "(default: found from the keys)",
    )
    dcp.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking the checkpoint's files against its manifest.json (their sizes and CRC-32s, which "
        "reads every file once, optimizer state included); needed to convert a checkpoint without a manifest "
        "(written by something other than D9DStrategy, or by a save that did not finish). Without it, only "
        "what converting itself checks is caught (keys, shapes, missing or truncated files), not flipped bytes",
    )
    dcp.add_argument(
        "--base",
        metavar="FOLDER",
        help="a LoRA run's checkpoint holds the adapters, not the frozen base: the Hugging Face folder of the base "
        "they were trained on, streamed and checked against the fingerprint the checkpoint records (another base "
        "is refused, naming a tensor), the adapters merged into its weights; its tokenizer and other non-weight "
        "files are copied unless --config names a directory",
    )
    dcp.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        help="a LoRA run's checkpoint: 'merged' (default) writes the base's weights with the adapters merged in "
        "(needs --base); 'adapter' the peft adapter directory (adapter_config.json, adapter_model.safetensors), "
        "for peft.PeftModel.from_pretrained on the base; no base is read, --base is only recorded in it",
    )
    _add_common(dcp)
    dcp.set_defaults(run=dcp_to_hf)

    hf = commands.add_parser(
        "hf-to-hf",
        description="Copy a Hugging Face directory through the model's mapping: re-shard, cast, change layout. "
        "Every key and shape is checked against its config.json first.",
    )
    hf.add_argument("source", help="a Hugging Face directory (config.json and safetensors weights)")
    hf.add_argument(
        "output", help="the directory to write (replaced only once complete; not inside the source)"
    )
    _add_common(hf)
    hf.set_defaults(run=hf_to_hf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
