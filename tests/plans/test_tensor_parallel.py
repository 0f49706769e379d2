"""Tensor parallelism for Qwen3 on gloo ranks: loss parallelism (values, gradients, no full-vocabulary tensor),
tied embeddings, sharding-independent init, and the sizes tp must divide (refused before any collective)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d import D9DStrategy
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.plans import (
    ParallelOptions,
    column_parallel,
    maybe_loss_parallel,
    parallelize_tensor,
    row_parallel_to_sequence,
    vocab_parallel_embedding,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))

# A vocabulary no other dim of the tiny model shares, so that a tensor with this dim is a vocabulary tensor.
VOCAB = 384


class RecordShapes(TorchDispatchMode):
    """The shapes of every tensor an op returns on this rank (a DTensor counts with its local shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, DTensor):
                self.shapes.add(tuple(tensor.to_local().shape))
            elif isinstance(tensor, torch.Tensor):
                self.shapes.add(tuple(tensor.shape))
        return out


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def batch(vocab: int, seq_len: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (2, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (2, seq_len), generator=generator)
    # ignored tokens count in neither the sum nor the mean; as many per row, so that the mean over data ranks
    # (what FSDP's gradient average gives without the strategy's token weighting) is the token mean
    labels[:, -3:] = -100
    return ids, labels


def loss_parallel_body() -> dict[str, Any]:
    """Cross-entropy of vocabulary-sharded logits against the full cross-entropy: values and gradients."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    _, labels = batch(VOCAB)
    logits = torch.randn(2, 8, VOCAB, generator=torch.Generator().manual_seed(3), requires_grad=True)
    expected = causal_lm_loss(logits, labels)
    expected.backward()
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(2)]).requires_grad_()
    with maybe_loss_parallel(True):
        loss = causal_lm_loss(sharded, labels)
        loss.backward()
    assert logits.grad is not None and sharded.grad is not None
    return {
        "loss_error": abs(float(full(loss)) - float(expected)),
        "grad_error": float((sharded.grad.full_tensor() - logits.grad).abs().max()),
        "local_grad_shape": tuple(sharded.grad.to_local().shape),
    }


def model_body(tp: int, tied: bool) -> dict[str, Any]:
    """Qwen3 parallelized over tp (and FSDP over the rest) against one process: init, loss, gradients, and
    the shapes that reach the loss."""
    config = Qwen3Config.tiny(vocab_size=VOCAB, tie_word_embeddings=tied)
    dims = ParallelDims(tp=tp).resolve(dist.get_world_size()).build_mesh("cpu")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.parallelize(dims, ParallelOptions())
    model.to_empty(device="cpu")
    model.init_weights(seed=11)
    reference = Qwen3ForCausalLM(config)
    reference.init_weights(seed=11)
    result: dict[str, Any] = {
        "init_error": max(
            float((full(p) - dict(reference.named_parameters())[n]).abs().max())
            for n, p in model.named_parameters()
        ),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,  # type: ignore[union-attr]
    }
    ids, labels = batch(VOCAB)
    dp_rank, dp = dims.mesh_for("dp").get_local_rank(), dims.dp
    rows = slice(dp_rank * 2 // dp, (dp_rank + 1) * 2 // dp)
    recorder = RecordShapes()
    with recorder, maybe_loss_parallel(True):
        logits = model(ids[rows])
        loss = full(causal_lm_loss(logits, labels[rows]))
        loss.backward()  # FSDP averages the gradients over the data ranks
    result["logits_local_shape"] = tuple(logits.to_local().shape)
    # [..., vocab]: logits or their gradient; [vocab, ...]: the whole embedding table or its gradient (torch's
    # own DTensor embedding backward builds that on every rank; VocabParallelEmbedding does not)
    result["vocab_shapes"] = sorted(shape for shape in recorder.shapes if shape[-1:] == (VOCAB,))
    result["table_shapes"] = sorted(shape for shape in recorder.shapes if shape[:1] == (VOCAB,))
    # the recorder can see one: gathering the logits makes the [B, T, vocab] tensor it must not find
    control = RecordShapes()
    with control:
        logits.detach().full_tensor()
    result["control_vocab_shapes"] = sorted(shape for shape in control.shapes if shape[-1:] == (VOCAB,))
    expected = causal_lm_loss(reference(ids), labels)
    expected.backward()
    losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    # ranks dp_rank * tp + tp_rank: one per data rank
    result["loss_error"] = abs(float(sum(losses[r] for r in range(0, dp * tp, tp)) / dp - expected))
    result["grad_error"] = max(
        float((full(p.grad) - dict(reference.named_parameters())[n].grad).abs().max())  # type: ignore[operator]
        for n, p in model.named_parameters()
    )
    # an uneven sequence split is refused at the first batch, with the numbers
    try:
        model(ids[rows, :7])
        result["uneven"] = None
    except ValueError as error:
        result["uneven"] = str(error)
    return result


def embedding_body() -> dict[str, Any]:
    """The vocabulary-parallel embedding on a tp mesh: shared parameters stay one Parameter when both styles
    shard them alike, and are refused otherwise; an embedding with a ``padding_idx`` looks up and trains as one
    process does."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    alike = nn.ModuleDict({"embedding": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    alike["head"].weight = alike["embedding"].weight  # both split over the 8 rows (Shard(0))
    parallelize_tensor(alike, mesh, {"embedding": vocab_parallel_embedding(), "head": column_parallel()})
    unlike = nn.ModuleDict({"embedding": nn.Embedding(8, 8), "down": nn.Linear(8, 8, bias=False)})
    unlike["down"].weight = unlike["embedding"].weight  # rows (Shard(0)) against columns (Shard(1))
    try:
        parallelize_tensor(
            unlike, mesh, {"embedding": vocab_parallel_embedding(), "down": row_parallel_to_sequence()}
        )
        error = "no error"
    except ValueError as raised:
        error = str(raised)
    return {
        "retied": alike["head"].weight is alike["embedding"].weight,
        "error": error,
        **padded_lookup(mesh),
    }


PADDING_IDX = 5  # among the second tp rank's rows (4-7 of 8)


def padded_lookup(mesh: Any) -> dict[str, Any]:
    """``nn.Embedding(8, 4, padding_idx=PADDING_IDX)`` under ``vocab_parallel_embedding`` against one process:
    this rank's positions of the output, and the gradient (the pad row's: none, as ``F.embedding`` gives)."""
    torch.manual_seed(0)
    reference = nn.Embedding(8, 4, padding_idx=PADDING_IDX)
    with torch.no_grad():  # the pad row not at zero, so that its gradient, not its value, is what is seen
        reference.weight[PADDING_IDX] = 1.0
    padded = nn.Embedding(8, 4, padding_idx=PADDING_IDX)
    padded.load_state_dict(reference.state_dict())
    parallelize_tensor(padded, mesh, {"": vocab_parallel_embedding()})
    ids = torch.tensor([[5, 1, 5, 6], [0, 5, 7, 2]])
    weights = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    expected = reference(ids)
    (expected * weights).sum().backward()
    out = padded(ids)  # this rank's half of the sequence
    positions = slice(mesh.get_local_rank() * 2, (mesh.get_local_rank() + 1) * 2)
    (out * weights[:, positions]).sum().backward()
    grad = full(padded.weight.grad)
    assert reference.weight.grad is not None
    return {
        "lookup_error": float((out - expected[:, positions]).abs().max()),
        "grad_error": float((grad - reference.weight.grad).abs().max()),
        "pad_grad": float(grad[PADDING_IDX].abs().max()),
    }


@functools.cache
def embedding_ranks() -> list[dict[str, Any]]:
    """One launch for the embedding tests."""
    return run_distributed(embedding_body, 2)


def test_loss_parallel_equals_full_cross_entropy() -> None:
    for rank in run_distributed(loss_parallel_body, 2):
        assert rank["loss_error"] <= 1e-6
        assert rank["grad_error"] <= 1e-7
        assert rank["local_grad_shape"] == (2, 8, VOCAB // 2)


@pytest.mark.parametrize(("world", "tp", "tied"), [(2, 2, False), (2, 2, True), (4, 2, False)])
def test_tensor_parallel_qwen3_matches_one_process(world: int, tp: int, tied: bool) -> None:
    for rank in run_distributed(model_body, world, tp, tied):
        assert rank["init_error"] == 0.0  # bitwise: each shard cut from the same full draw
        assert rank["tied"] == tied
        assert rank["logits_local_shape"] == (2 * tp // world, 8, VOCAB // tp)
        assert rank["vocab_shapes"] == [], "a full-vocabulary tensor was materialised"
        assert rank["table_shapes"] == [], "a whole embedding table (or its gradient) was materialised"
        assert (2 * tp // world, 8, VOCAB) in rank["control_vocab_shapes"]
        assert rank["loss_error"] <= 1e-6
        assert rank["grad_error"] <= 1e-6
        assert rank["uneven"] is not None and "divisible by tp: 7 % 2 = 1" in rank["uneven"]


def test_shared_parameters_are_retied_or_refused() -> None:
    for rank in embedding_ranks():
        assert rank["retied"]
        assert (
            "a shared parameter (weight of Embedding and weight of Linear) got two layouts" in rank["error"]
        )


def test_the_vocabulary_parallel_lookup_gives_the_pad_row_no_gradient() -> None:
    for rank in embedding_ranks():
        assert rank["lookup_error"] == 0.0
        assert rank["pad_grad"] == 0.0
        assert rank["grad_error"] <= 1e-6


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 2},
            4,
            r"tp \(4\) must divide num_attention_heads \(6\)",
        ),
        ({"num_key_value_heads": 2}, 4, r"tp \(4\) must divide num_key_value_heads \(2\)"),
        ({"intermediate_size": 130}, 4, r"tp \(4\) must divide intermediate_size \(130\)"),
        ({"vocab_size": 250}, 4, r"tp \(4\) must divide vocab_size \(250\)"),
    ],
)
def test_sizes_tp_does_not_divide_are_refused_before_any_collective(
    overrides: dict[str, int], tp: int, message: str
) -> None:
    # No process group exists in this process: reaching any collective (or the mesh) would fail differently.
    config = Qwen3Config.tiny(**{"num_key_value_heads": 4, **overrides})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    with pytest.raises(ValueError, match=f"Qwen3ForCausalLM: {message}"):
        model.parallelize(ParallelDims(tp=tp), ParallelOptions())


def test_strategy_accepts_tp() -> None:
    # the default plan still refuses tp for models without a plan (tests/plans/test_required_degrees.py)
    assert D9DStrategy(tp=2)._requested_dims.tp == 2


def hf_body(directory: str, ids: torch.Tensor) -> torch.Tensor:
    """Load a Hugging Face checkpoint into a tp=2 x dp_shard=2 Qwen3 and return its logits (whole)."""
    from hf_helpers import config_json

    from lightning_d9d.state.hf.io import load_hf

    config = Qwen3Config.from_hf_dict(config_json(Path(directory)))
    dims = ParallelDims(tp=2, dp_shard=2).resolve(dist.get_world_size()).build_mesh("cpu")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.parallelize(dims, ParallelOptions())
    model.to_empty(device="cpu")
    model.model.rotary_emb.reset_parameters()
    load_hf(model, directory)
    with torch.no_grad(), maybe_loss_parallel(True):
        return model(ids).full_tensor()


@pytest.mark.parametrize("tied", [False, True])
def test_hf_weights_load_into_tp2_dp2(tied: bool, tmp_path: Path) -> None:
    from hf_helpers import batch as hf_batch
    from hf_helpers import hf_logits, make_hf_checkpoint

    reference = make_hf_checkpoint(tmp_path, tie_word_embeddings=tied)
    ids = hf_batch(reference.config.vocab_size)
    expected = hf_logits(reference, ids)
    for logits in run_distributed(hf_body, 4, str(tmp_path), ids):
        assert (logits - expected).abs().max() <= 1e-5


def test_tied_embeddings_across_stages_are_refused_under_tp() -> None:
    model = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=True))
    stage = model.pipeline_stage([0], first=True, last=False)
    with pytest.raises(NotImplementedError, match="needs the embedding and the head in one stage"):
        stage.parallelize(ParallelDims(pp=2, tp=2), ParallelOptions())
