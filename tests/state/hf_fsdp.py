"""The two-rank FSDP round trip the Hugging Face tests of every model run: our model sharded over 2 gloo ranks,
loaded from transformers' files, run, and written back; its logits and the export checked against transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from distributed import run_distributed
from hf_helpers import hf_logits, load_transformers

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.state.hf import load_hf, save_hf


def _fsdp_rank(
    make_model: Callable[[Path], Any], sharded: str, directory: Path, out: Path, ids: torch.Tensor
) -> None:
    rank = torch.distributed.get_rank()
    dims = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
    with torch.device("meta"):
        model = make_model(directory)
    model.parallelize(dims, ParallelOptions())
    model.to_empty(device="cpu")
    model.init_weights(100 + rank)  # different on each rank: loading must overwrite every shard
    load_hf(model, directory)
    local = tuple(model.get_parameter(sharded).to_local().shape)
    with torch.no_grad():
        logits = model(ids)
    save_hf(model, out / "export", max_shard_bytes=30_000)  # a collective: every rank gathers, rank 0 writes
    torch.save({"logits": logits, "local": local}, out / f"rank{rank}.pt")


def check_fsdp_load_and_export(
    make_model: Callable[[Path], Any],
    sharded: str,
    local_shapes: Sequence[tuple[int, ...]],
    hf: Any,
    ids: torch.Tensor,
    directory: Path,
    out: Path,
    tolerance: float,
) -> None:
    """``make_model(directory)`` (built on meta) sharded with FSDP over 2 ranks and loaded from the HF files of
    ``directory`` gives ``hf``'s logits on ``ids`` on every rank, with parameter ``sharded`` really split
    (``local_shapes[rank]`` on each); its export to ``out / "export"`` (several shards) loads in transformers
    with the same logits. Each rank leaves ``out / f"rank{rank}.pt"`` behind."""
    expected = hf_logits(hf, ids)
    run_distributed(_fsdp_rank, 2, make_model, sharded, directory, out, ids, timeout=120)
    for rank, shape in enumerate(local_shapes):
        result = torch.load(out / f"rank{rank}.pt")
        assert result["local"] == shape, (rank, result["local"])  # really sharded
        torch.testing.assert_close(result["logits"], expected, rtol=tolerance, atol=tolerance)
    back = load_transformers(out / "export")
    torch.testing.assert_close(hf_logits(back, ids), expected, rtol=tolerance, atol=tolerance)
