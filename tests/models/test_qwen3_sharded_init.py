"""A model built on meta, sharded with FSDP2, ``to_empty``'d and initialised equals one built whole, bitwise."""

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules import canonical_param_name, causal_lm_loss
from lightning_d9d.plans import ParallelOptions

SEED = 1234


def batch(config: Qwen3Config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def sharded_rank(config: Qwen3Config, activation_checkpointing: bool, out_dir: Path) -> Path:
    dims = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.parallelize(dims, ParallelOptions(activation_checkpointing=activation_checkpointing))
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    params = {canonical_param_name(n): p.full_tensor() for n, p in model.named_parameters()}
    ids = batch(config)
    loss = causal_lm_loss(model(ids)[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {canonical_param_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    result = {
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "params": params,
        "loss": loss.detach(),
        "grads": grads,
    }
    # Through a file, not the result queue: a rank leaves with os._exit, which can cut off a large message
    # still being written by the queue's feeder thread.
    path = out_dir / f"rank{torch.distributed.get_rank()}.pt"
    torch.save(result, path)
    return path


@pytest.mark.parametrize(
    ("overrides", "activation_checkpointing"),
    [
        # 255 rows: uneven FSDP shards of the embedding (128 + 127), padded inside FSDP.
        ({"tie_word_embeddings": True, "vocab_size": 255}, False),
        ({"tie_word_embeddings": False}, True),
    ],
)
def test_meta_fsdp2_init_equals_whole_model_init(
    overrides: dict[str, Any], activation_checkpointing: bool, tmp_path: Path
) -> None:
    config = Qwen3Config.tiny(**overrides)
    paths = run_distributed(sharded_rank, 2, config, activation_checkpointing, tmp_path, timeout=120)
    results = [torch.load(path) for path in paths]
    reference = Qwen3ForCausalLM(config)
    reference.init_weights(SEED)
    ids = batch(config)
    loss = causal_lm_loss(reference(ids)[:, :-1], ids[:, 1:])
    loss.backward()
    expected = dict(reference.named_parameters())
    for rank, result in enumerate(results):
        assert result["tied"] == config.tie_word_embeddings
        assert result["params"].keys() == expected.keys()
        for name, value in result["params"].items():
            assert torch.equal(value, expected[name].detach()), f"rank {rank}: {name} differs"
        # Same batch on both ranks: FSDP's averaged gradients equal the single-process ones.
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-5, atol=1e-6, msg=name)
