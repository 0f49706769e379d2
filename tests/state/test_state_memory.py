"""Peak memory of the command line converting a 2.25 GiB checkpoint: a few groups plus one shard, never the model.

``python -m lightning_d9d.convert hf-to-hf`` re-shards and casts a random Qwen3 checkpoint written by the test, in a
process of its own; ``--stats`` reports its RSS right before converting (after the imports and the header
checks) and its peak since then (``VmHWM``, reset when the conversion starts), and the growth between the two must
stay under ``4 x largest group + one output shard``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_d9d.models import Qwen3Config
from lightning_d9d.state.hf import qwen3_hf_shapes

MiB = 2**20
# fp32: q/o 64 MiB, k/v 16 MiB, gate/up/down 128 MiB each (the largest groups), embedding and head 64 MiB.
CONFIG = Qwen3Config(
    vocab_size=4096,
    hidden_size=4096,
    intermediate_size=8192,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
FILES = 12
MAX_SHARD_BYTES = 256 * MiB


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # Cheap, distinct and not all zeros (pages of zeros could be shared and would flatter the measurement).
    numel = 1
    for size in shape:
        numel *= size
    return torch.arange(numel, dtype=torch.float32).add_(seed * 0.5).reshape(shape)


def _write_source(directory: Path) -> dict[str, tuple[int, ...]]:
    """An HF directory: config.json, FILES shards (keys dealt round-robin, so files interleave), the index."""
    shapes = qwen3_hf_shapes(CONFIG.to_hf_dict())
    names = [f"model-{n + 1:05d}-of-{FILES:05d}.safetensors" for n in range(FILES)]
    weight_map = {key: names[position % FILES] for position, key in enumerate(shapes)}
    directory.mkdir()
    for name in names:
        shard = {
            key: _tensor(shape, seed)
            for seed, (key, shape) in enumerate(shapes.items())
            if weight_map[key] == name
        }
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        del shard
    total = sum(4 * torch.Size(shape).numel() for shape in shapes.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    return shapes


@pytest.mark.slow
def test_command_line_conversion_peak_rss_is_a_few_groups_plus_a_shard(tmp_path: Path) -> None:
    source, destination = tmp_path / "source", tmp_path / "destination"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
        ),
    )
    try:
        shapes = _write_source(source)
        command = [
            sys.executable,
            "-m",
            "lightning_d9d.convert",
            "hf-to-hf",
            str(source),
            str(destination),
            "--model",
            "qwen3",
            "--dtype",
            "bfloat16",
            "--max-shard-size",
            str(MAX_SHARD_BYTES),
            "--stats",
        ]
        # 1 GiB held by this process while it launches the conversion: a peak that counted the launcher's memory
        # (getrusage's ru_maxrss carries the forked parent's RSS across exec) fails the bound below.
        launcher_ballast = torch.ones(256 * MiB)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        del launcher_ballast
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])

        largest = report["largest_group_bytes"]
        assert largest == 4 * CONFIG.intermediate_size * CONFIG.hidden_size
        assert report["bytes_read"] >= 2 * 2**30
        # Against the RSS right before converting, to the high-water mark since then. A group read in fp32, its bf16
        # outputs, the shard being filled and the one being written: 500 MiB at most, measured 440-490 MiB. Loading
        # the model whole (2304 MiB) fails it three times over; keeping every converted bf16 tensor instead of
        # writing shards (1152 MiB + a group) fails it too.
        growth = report["peak_rss_bytes"] - report["rss_before_bytes"]
        bound = 4 * largest + MAX_SHARD_BYTES
        print(
            f"\ncheckpoint {report['bytes_read'] / MiB:.0f} MiB in {FILES} files -> {report['bytes_written'] / MiB:.0f}"
            f" MiB (bf16) in {report['shards']} shards; largest group {largest / MiB:.0f} MiB; shard "
            f"{MAX_SHARD_BYTES / MiB:.0f} MiB; converted in {report['seconds']:.1f} s\n"
            f"RSS: before {report['rss_before_bytes'] / MiB:.0f} MiB, peak {report['peak_rss_bytes'] / MiB:.0f} MiB,"
            f" growth {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
        )
        assert growth < bound

        # The output is right: spot-check a few tensors by slices, cheaply.
        index = json.loads((destination / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(shapes)
        for seed, (key, shape) in enumerate(shapes.items()):
            if seed % 7:
                continue
            with safe_open(str(destination / index[key]), framework="pt") as handle:
                stored = handle.get_slice(key)
                assert tuple(stored.get_shape()) == shape
                first = stored[:5] if len(shape) == 1 else stored[:1, :5]
                expected = _tensor(shape, seed).to(torch.bfloat16)
                assert torch.equal(first, expected[:5] if len(shape) == 1 else expected[:1, :5]), key
        assert json.loads((destination / "config.json").read_text())["dtype"] == "bfloat16"
    finally:
        # pytest keeps the last few runs' tmp directories: 3.4 GiB each time is too much to leave behind.
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(destination, ignore_errors=True)
