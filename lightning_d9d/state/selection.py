"""Which checkpoint to resume from, and which ones may be deleted.

``Trainer.fit(ckpt_path=<folder of checkpoints>)`` resolves to the newest *complete* checkpoint in that folder:
a directory with a ``manifest.json`` whose files all exist with the listed sizes (checksums are checked by the
load itself). Newest means the latest manifest, the file a save writes last. Every other candidate that was
passed over for being incomplete is logged with the reason. (``ckpt_path="last"`` is Lightning's: it resolves
to the newest ``last*.ckpt`` of the ``ModelCheckpoint`` callbacks, which an atomic save keeps complete; if
that one fails its checks anyway, the error carries a note naming the newest other complete checkpoint.) A
Hugging Face model folder (or safetensors file) given as ``ckpt_path`` is refused naming its files and
``LoadHFWeights``, which is how a run starts from such weights.

Deleting (``save_top_k`` / keep-last-N, through the strategy's ``remove_checkpoint``) never removes the only
complete checkpoint of a folder; a link to it does not count as another.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import manifest
from .errors import CheckpointError, MissingShardError

log = logging.getLogger(__name__)

META_NAME = "meta.pt"  # everything but the tensors: loops, callbacks, hyper-parameters
DCP_METADATA_NAME = ".metadata"  # DCP's own index of the tensors and where their chunks lie
# what a Hugging Face model folder holds, and a training checkpoint never does
HF_CONFIG_NAME, HF_WEIGHTS_SUFFIX = "config.json", ".safetensors"


def looks_like_checkpoint(path: Path) -> bool:
    """A training checkpoint's directory, complete or not (it has any of the files a save writes)."""
    return path.is_dir() and any(
        (path / name).exists() for name in (META_NAME, DCP_METADATA_NAME, manifest.MANIFEST_NAME)
    )


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (cheap: the manifest and file sizes), or None if it is."""
    try:
        manifest.check_sizes(path, manifest.read_manifest(path))
    except CheckpointError as error:
        return str(error)
    return None


def newest_complete(folder: Path, *, besides: Path | None = None) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest complete checkpoint directly inside ``folder`` (other than ``besides``), and the newer ones
    skipped with why.

    Hidden entries (temporary and set-aside directories of saves in flight or crashed) are never candidates.
    """
    candidates = [
        entry
        for entry in folder.iterdir()
        if not entry.name.startswith(".") and entry != besides and looks_like_checkpoint(entry)
    ]

    def written(entry: Path) -> float:
        for name in (manifest.MANIFEST_NAME, META_NAME, DCP_METADATA_NAME):
            if (entry / name).exists():
                return (entry / name).stat().st_mtime
        return entry.stat().st_mtime

    skipped: list[tuple[Path, str]] = []
    for candidate in sorted(candidates, key=lambda entry: (written(entry), entry.name), reverse=True):
        reason = incomplete_reason(candidate)
        if reason is None:
            return candidate, skipped
        skipped.append((candidate, reason))
    listed = "".join(f"\n  {path.name}: {reason}" for path, reason in skipped)
    raise MissingShardError(
        f"{folder} holds no complete checkpoint to resume from"
        + (f"; incomplete:{listed}" if skipped else " (no checkpoint directories at all)"),
        path=str(folder),
    )


def other_complete_hint(path: Path) -> str | None:
    """For a checkpoint ``path`` that failed its checks: the fix, naming the newest other complete checkpoint
    of its folder (None if there is none). ``ckpt_path="last"`` resolves to a ``last*.ckpt`` by Lightning's
    own rules, which know nothing of completeness; falling back silently would need its private API, and a
    path the user named is never replaced by another."""
    try:
        other, _ = newest_complete(path.parent, besides=path)
    except (CheckpointError, OSError):
        return None
    return (
        f"{path.name} (what ckpt_path='last' resolves to, if it is the newest last*.ckpt) cannot be loaded; "
        f"the newest other complete checkpoint in {path.parent} is {other.name}: resume with "
        f"ckpt_path={str(other)!r}, or ckpt_path={str(path.parent)!r} after deleting or repairing {path.name}"
    )


def hf_model_files(path: Path) -> list[str]:
    """The Hugging Face model files ``path`` is or holds (``config.json``, ``*.safetensors`` and their index),
    sorted; empty for anything else."""
    if path.is_file():
        return [path.name] if path.suffix == HF_WEIGHTS_SUFFIX else []
    if not path.is_dir():
        return []
    return sorted(
        entry.name
        for entry in path.iterdir()
        if entry.is_file()
        and (
            entry.name == HF_CONFIG_NAME
            or entry.suffix == HF_WEIGHTS_SUFFIX
            or entry.name.endswith(".index.json")
        )
    )


def hf_model_error(path: Path) -> CheckpointError | None:
    """The refusal of ``path`` as a checkpoint to resume from when it is a Hugging Face model (a folder or a
    safetensors file), else None: such weights are where a run starts, loaded by ``LoadHFWeights``; ``ckpt_path``
    continues a run from a checkpoint the run saved."""
    found = hf_model_files(path)
    if not found:
        return None
    folder = path if path.is_dir() else path.parent
    listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return CheckpointError(
        f"ckpt_path {str(path)!r} is a Hugging Face model, not a training checkpoint (it holds {listed}; no "
        f"{META_NAME} or {DCP_METADATA_NAME}). A Hugging Face folder is loaded with the LoadHFWeights({str(folder)!r}) "
        "callback (lightning_d9d.callbacks) at the start of a fit without ckpt_path; ckpt_path is for training "
        "checkpoints, the directories ModelCheckpoint saves, to resume a run"
    )


def _choose(path: Path) -> Path:
    if not path.is_dir() or looks_like_checkpoint(path):
        return path  # a checkpoint itself (complete or not: its load says what is wrong), or nothing
    try:
        chosen, skipped = newest_complete(path)
    except CheckpointError:
        # no checkpoint in it, but a model's files: say what it is and where it goes
        refusal = hf_model_error(path)
        if refusal is not None:
            raise refusal from None
        raise
    for entry, reason in skipped:
        log.warning("skipping checkpoint %s: %s", entry, reason)
    log.warning("resuming from %s, the newest complete checkpoint in %s", chosen, path)
    return chosen


def resolve(path: Path, *, distributed: bool) -> Path:
    """``path`` itself, or for a folder of checkpoints the newest complete one (rank 0 decides and logs; every
    rank gets its choice, or its error)."""
    if not distributed:
        return _choose(path)
    import torch.distributed as dist

    from .atomic import agree

    def on_rank_zero() -> Path | None:
        return _choose(path) if dist.get_rank() == 0 else None

    choice = [agree(on_rank_zero, distributed=True)]
    dist.broadcast_object_list(choice, src=0)
    assert choice[0] is not None
    return Path(choice[0])


def keep(path: Path) -> bool:
    """Whether a deletion of ``path`` is to be refused (and logged): see :func:`keep_reason`."""
    reason = keep_reason(path)
    if reason is not None:
        log.warning("not deleting %s: %s", path, reason)
    return reason is not None


def keep_reason(path: Path) -> str | None:
    """Why deleting the checkpoint ``path`` would be wrong (it is the only complete one in its folder), or None.
    A link to it (``ModelCheckpoint(save_last="link")``'s ``last.ckpt``) is not another checkpoint."""
    if not path.is_dir() or incomplete_reason(path) is not None:
        return None
    itself = path.resolve()
    others = [
        entry
        for entry in path.parent.iterdir()
        if not entry.name.startswith(".") and entry.resolve() != itself and looks_like_checkpoint(entry)
    ]
    if any(incomplete_reason(entry) is None for entry in others):
        return None
    return f"{path} is the only complete checkpoint in {path.parent}"
