"""A transformers model built on ``meta`` in ``configure_model`` is initialised by its own rules, alike on any
layout. Its ``init_weights()`` was taken for our ``SeededInit`` and called with a seed (a
``TypeError``); initialised shard by shard it would also differ between one process and FSDP over two.

Each run records, after the strategy's setup, the full parameters and buffers and the logits of one batch, then
trains a step. One process, two forked gloo ranks (``dp_shard=2``) and one process with plain parameters must
hold bitwise the same values, drawn as transformers draws them (normal(0, ``initializer_range``) weights, zero
biases, unit norms), the RoPE tables of an eagerly built model (non-persistent buffers: ``to_empty`` leaves them
garbage), a tied head still tied, and the logits of an eager model loaded with the same weights.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from distributed import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy
from lightning_d9d.modules.hf_init import init_transformers_model_, is_transformers_model

SEED = 1234
INPUT = torch.arange(24).reshape(2, 12) % 96


def _qwen3() -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    return transformers.Qwen3ForCausalLM(config)


def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,  # biases must come out zero
        initializer_range=0.05,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",  # not the default RoPE: its own inverse frequencies
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    return transformers.LlamaForCausalLM(config)


BUILDERS = {"qwen3": _qwen3, "llama": _llama}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class HFModule(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model: nn.Module | None = None
        self.record: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = BUILDERS[self.name]()

    def on_fit_start(self) -> None:  # after the strategy sharded and initialised the model
        model = self.model
        assert model is not None
        self.record["params"] = {n: _full(p) for n, p in model.named_parameters(remove_duplicate=False)}
        self.record["buffers"] = {n: _full(b) for n, b in model.named_buffers()}
        self.record["dtensor_mesh"] = {
            p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)
        } or None
        with torch.no_grad():
            self.record["logits"] = model(input_ids=INPUT).logits.detach().clone()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        loss = self.model(input_ids=batch, labels=batch).loss
        self.record["loss"] = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(name: str, fsdp: bool = True) -> dict[str, Any]:
    trainer = L.Trainer(
        strategy=D9DStrategy(fsdp_on_one_rank=fsdp),
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = HFModule(name)
    trainer.fit(module, DataLoader(INPUT[:1].repeat(4, 1), batch_size=2))  # every rank, every batch alike
    model = module.model
    assert model is not None and trainer.global_step == 1
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    module.record["tied"] = embedding.weight is head.weight
    return module.record


def _fit_on_two_ranks(names: list[str]) -> list[dict[str, Any]]:
    rank = int(os.environ["RANK"])
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="hf-meta-init")
    torch.manual_seed(SEED + rank)  # the strategy initialises from rank 0's seed
    return [_fit(name) for name in names]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Per model: the one-process run (FSDP over one rank), then the others: both ranks of FSDP over two, and
    one process with plain parameters (``fsdp_on_one_rank=False``: ``to_empty`` there used to untie the head)."""
    names = list(BUILDERS)
    sharded = run_distributed(_fit_on_two_ranks, 2, names, timeout=240)
    single: dict[str, dict[str, Any]] = {}
    plain: dict[str, dict[str, Any]] = {}
    environment = dict(os.environ)
    for name, fsdp in itertools.product(names, (True, False)):
        torch.manual_seed(SEED)
        try:
            (single if fsdp else plain)[name] = _fit(name, fsdp)
        finally:  # the next Trainer sets up its own group; Lightning's variables go
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(environment)
    return {name: (single[name], [sharded[0][i], sharded[1][i], plain[name]]) for i, name in enumerate(names)}


def _eager(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_process_and_fsdp_over_two_hold_the_same_initial_values(name: str, runs: Any) -> None:
    single, others = runs[name]
    meshes = [single["dtensor_mesh"], *(record["dtensor_mesh"] for record in others)]
    assert meshes == [{1}, {2}, {2}, None]  # FSDP over 1 rank, over 2, then plain parameters
    for record in others:
        for kind in ("params", "buffers"):
            assert record[kind].keys() == single[kind].keys()
            for key, value in single[kind].items():
                assert torch.equal(record[kind][key], value), f"{kind} {key} differs between the layouts"
    assert all(r["loss"] == pytest.approx(single["loss"]) for r in others)  # and it trained one step


@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_values_are_drawn_by_transformers_rules(name: str, runs: Any) -> None:
    single, _ = runs[name]
    params, eager = single["params"], _eager(name)
    std = eager.config.initializer_range
    assert params.keys() == dict(eager.named_parameters(remove_duplicate=False)).keys()
    for key, value in params.items():
        assert torch.isfinite(value).all(), key
        if "norm" in key:
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith(".bias"):
            assert torch.equal(value, torch.zeros_like(value)), key
        else:
            assert value.dim() == 2, key
            assert value.std().item() == pytest.approx(std, rel=0.08), key
            assert abs(value.mean().item()) < 0.1 * std, key
    weights = [value for key, value in params.items() if key.endswith("proj.weight")]
    assert len({tuple(value.flatten()[:8].tolist()) for value in weights}) == len(
        weights
    )  # each its own draw


@pytest.mark.parametrize("name", list(BUILDERS))
def test_rope_tables_tied_head_and_logits_match_an_eager_model(name: str, runs: Any) -> None:
    single, others = runs[name]
    eager = _eager(name)
    for key, value in eager.named_buffers():  # RoPE inv_freq, original_inv_freq: non-persistent
        assert torch.allclose(single["buffers"][key], value), key
    tied = bool(eager.config.tie_word_embeddings)
    head = "lm_head.weight"
    assert single["tied"] is tied and all(r["tied"] is tied for r in others)
    assert torch.equal(single["params"][head], single["params"]["model.embed_tokens.weight"]) is tied
    eager.load_state_dict(single["params"])
    with torch.no_grad():
        expected = eager(input_ids=INPUT).logits
    for record in (single, *others):
        torch.testing.assert_close(record["logits"], expected, rtol=1e-5, atol=1e-5)


def test_only_transformers_models_are_taken_and_nothing_is_left_unwritten() -> None:
    assert not is_transformers_model(nn.Linear(2, 2)) and is_transformers_model(_eager("qwen3"))
    with torch.device("meta"):
        model = _qwen3()
    model.to_empty(device="cpu")  # no sharding: plain tensors (the tie is lost by to_empty: two heads)
    assert init_transformers_model_(model, SEED) == []
    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    init_transformers_model_(model, SEED)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left alone
    assert torch.initial_seed() == 7  # the seed the strategy reads
