"""Peak memory of a streaming conversion of a 2 GiB checkpoint: a few groups plus one shard, never the model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memory_probe import dense_key, expert_key
from safetensors import safe_open
from safetensors.torch import save_file

MiB = 2**20
SIDE = 4096  # one fp32 tensor of SIDE x SIDE is 64 MiB
LAYERS, EXPERTS, DENSE, FILES = 4, 4, 16, 16  # 32 tensors of 64 MiB = 2 GiB in 16 files
MAX_SHARD_BYTES = 256 * MiB
PROBE = Path(__file__).with_name("memory_probe.py")


def _tensor(seed: int) -> torch.Tensor:
    # Cheap, distinct and not all zeros (pages of zeros could be shared and would flatter the measurement).
    return torch.arange(SIDE * SIDE, dtype=torch.float32).add_(seed * 0.5).reshape(SIDE, SIDE)


def _write_source(directory: Path) -> list[str]:
    """Keys dealt round-robin over the files, so each stack group reads from several files."""
    keys = [expert_key(i, e) for i in range(LAYERS) for e in range(EXPERTS)] + [
        dense_key(j) for j in range(DENSE)
    ]
    names = [f"model-{n + 1:05d}-of-{FILES:05d}.safetensors" for n in range(FILES)]
    weight_map = {key: names[position % FILES] for position, key in enumerate(keys)}
    weight_map["norm.weight"] = names[0]
    directory.mkdir()
    for name in names:
        shard = {key: _tensor(keys.index(key)) for key in keys if weight_map[key] == name}
        if name == names[0]:
            shard["norm.weight"] = torch.ones(SIDE)
        save_file(shard, str(directory / name))
        del shard
    index = {"metadata": {"total_size": len(keys) * SIDE * SIDE * 4 + SIDE * 4}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return keys


@pytest.mark.slow
def test_conversion_peak_rss_is_a_few_groups_plus_a_shard(tmp_path: Path) -> None:
    source, destination = tmp_path / "source", tmp_path / "destination"
    paths = [str(Path(__file__).parents[2]), str(PROBE.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in paths if path))
    # Started first: it imports while this process writes the checkpoint, and waits for its arguments.
    probe = subprocess.Popen(
        [sys.executable, str(PROBE)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _write_source(source)
        args = [str(source), str(destination), MAX_SHARD_BYTES, LAYERS, EXPERTS, DENSE]
        stdout, stderr = probe.communicate(json.dumps(args) + "\n", timeout=300)
        assert probe.returncode == 0, stderr[-3000:]
        report = json.loads(stdout.strip().splitlines()[-1])

        largest = report["largest_group_bytes"]
        assert largest == EXPERTS * SIDE * SIDE * 4
        assert report["checkpoint_bytes"] >= 2 * 2**30
        # Against the RSS right before converting (not the import-time high-water mark, which may be higher and
        # would hide part of the conversion's own peak).
        growth = report["peak"] - report["baseline_now"]
        bound = 3 * largest + MAX_SHARD_BYTES
        print(
            f"\ncheckpoint {report['checkpoint_bytes'] / MiB:.0f} MiB in {FILES} files; largest group "
            f"{largest / MiB:.0f} MiB; shard {MAX_SHARD_BYTES / MiB:.0f} MiB; converted in {report['seconds']:.1f} s\n"
            f"RSS: baseline {report['baseline_now'] / MiB:.0f} MiB (import peak {report['baseline_peak'] / MiB:.0f}),"
            f" peak {report['peak'] / MiB:.0f} MiB, growth {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
        )
        assert growth < bound

        # The output is right: spot-check a stacked expert and a transposed dense tensor (by slices, cheaply).
        index = json.loads((destination / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(destination / index["layers.2.experts"]), framework="pt") as handle:
            stacked = handle.get_slice("layers.2.experts")
            assert stacked.get_shape() == [EXPERTS, SIDE, SIDE]
            assert torch.equal(stacked[3, :2, :5], _tensor(2 * EXPERTS + 3)[:2, :5])
        with safe_open(str(destination / index[dense_key(1)]), framework="pt") as handle:
            row = handle.get_slice(dense_key(1))[:1, :5]
            assert torch.equal(row, _tensor(LAYERS * EXPERTS + 1)[:5, :1].T)
        assert sum(p.stat().st_size for p in destination.glob("*.safetensors")) >= report["checkpoint_bytes"]
    finally:
        if probe.poll() is None:
            probe.kill()
        # pytest keeps the last few runs' tmp directories: 4 GiB each time is too much to leave behind.
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(destination, ignore_errors=True)
