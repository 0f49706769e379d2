from __future__ import annotations

import pytest
import torch

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.pipeline import (
    balanced_stage_layers,
    check_microbatch_split,
    rank_of_stage,
    stages_of_rank,
)


def test_balanced_split_counts_embedding_and_head() -> None:
    assert balanced_stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a head worth 3 layers pushes layers to the first stage
    assert [len(s) for s in balanced_stage_layers(8, 2, embedding_weight=0, head_weight=3)] == [6, 2]
    assert balanced_stage_layers(5, 2, layers_per_stage=[1, 4]) == [[0], [1, 2, 3, 4]]


def test_split_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"the model has 3 layers, fewer than the 4 pipeline stages"):
        balanced_stage_layers(3, 4)
    with pytest.raises(
        ValueError, match=r"layers_per_stage \[2, 2\] must have 2 positive entries adding up to 5"
    ):
        balanced_stage_layers(5, 2, layers_per_stage=[2, 2])


def test_stage_placement() -> None:
    assert stages_of_rank(0, 2, 2, v_shape=False) == [0, 2]
    assert stages_of_rank(0, 2, 2, v_shape=True) == [0, 3]
    assert rank_of_stage(3, 2, 2, v_shape=True) == 0
    assert rank_of_stage(3, 4, 1, v_shape=False) == 3


def test_batch_must_split_into_microbatches() -> None:
    check_microbatch_split(8, 4)
    with pytest.raises(
        ValueError, match=r"per-rank batch size \(6\) must be divisible by microbatches \(4\)"
    ):
        check_microbatch_split(6, 4)


def test_stages_keep_global_names_and_compose_to_the_model() -> None:
    torch.manual_seed(0)
    config = Qwen3Config.tiny(num_hidden_layers=4)
    whole = Qwen3ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    parts = []
    for layer_ids, first, last in (([0, 1], True, False), ([2, 3], False, True)):
        part = Qwen3ForCausalLM(config)
        part.load_state_dict(whole.state_dict())
        part.pipeline_keep(layer_ids, first=first, last=last)
        parts.append(part.pipeline_stage(layer_ids, first=first, last=last))
        assert all(
            name.startswith(("model.layers.", "model.embed", "model.norm", "lm_head"))
            for name, _ in part.named_parameters()
        )
    assert {n for n, _ in parts[1].named_parameters()} >= {"layers.2.mlp.up_proj.weight", "lm_head.weight"}
    torch.testing.assert_close(parts[1](parts[0](ids)), whole(ids), rtol=0, atol=0)


def test_a_tied_head_keeps_its_copy_on_the_last_stages_rank() -> None:
    """Each rank keeps its end of a tied embedding and head: the first stage's the embedding, the last stage's
    the head (the same tensor until the ranks give each its own memory; the runner then trains them as one)."""
    first = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=True))
    first.pipeline_keep([0], first=True, last=False)
    assert first.model.embed_tokens is not None and first.lm_head is None
    last = Qwen3ForCausalLM(Qwen3Config.tiny(tie_word_embeddings=True))
    embedding = last.model.embed_tokens.weight
    last.pipeline_keep([1], first=False, last=True)
    assert last.model.embed_tokens is None and last.lm_head is not None and last.lm_head.weight is embedding
