"""``parallelize_context`` and ``split_batch``: a cp-split Qwen3 gives each rank the full model's logits at its
positions and, summed over the cp ranks, the full model's gradients (2 forked gloo ranks, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, summed_gradient_differences
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.modules.context_attention import AllGatherAttention, LoadBalancedSplit
from lightning_d9d.plans import parallelize_context, split_batch

TOLERANCE = 1e-5


def test_split_batch_cuts_the_target_and_the_inputs_shaped_like_it() -> None:
    split = LoadBalancedSplit(2, 1)
    ids = torch.arange(16).view(2, 8)
    labels = ids + 100
    scale = torch.tensor([3.0, 4.0])  # not [B, T]: passes through
    (ids_part, scale_part), labels_part = split_batch(split, (ids, scale), labels)
    assert ids_part.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert labels_part.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert scale_part is scale


def test_split_batch_names_a_sequence_length_not_divisible_by_twice_cp() -> None:
    with pytest.raises(
        ValueError, match=r"divisible by 2\*cp: 14 % \(2\*2\) = 2; pad or cut .* multiple of 4"
    ):
        split_batch(LoadBalancedSplit(2, 0), (torch.zeros(2, 14),), torch.zeros(2, 14))


def _refuses_modules_without_attention() -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match="Sequential has no lightning_d9d Attention module") as error:
        parallelize_context(nn.Sequential(nn.Linear(2, 2)), mesh)
    return str(error.value)


def _qwen3_parity() -> dict[str, float]:
    """Each rank's logits (absolute) and each parameter's gradient summed over the ranks (relative to its
    largest entry) vs the whole model's."""
    config = Qwen3Config.tiny(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config)  # the same weights on every rank
    full_model = Qwen3ForCausalLM(config)
    full_model.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=generator)
    weights = torch.randn(2, 24, config.vocab_size, generator=generator)

    full_logits = full_model(ids)
    (full_logits * weights).sum().backward()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    split = parallelize_context(model, mesh)
    assert model.model.context_split == split == LoadBalancedSplit(2, dist.get_rank())
    assert all(
        isinstance(layer.self_attn.context, AllGatherAttention) for layer in model.model.layers.values()
    )
    (local_ids,), local_weights = split_batch(split, (ids,), weights)
    logits = model(local_ids)
    (logits * local_weights).sum().backward()
    differences = {"logits": (logits - split.split(full_logits.detach())).abs().max().item()}
    # relative to the largest gradient entry: a sum over 12k weighted logits has large gradients
    return differences | summed_gradient_differences(model, full_model)


def test_parallelize_context_refuses_a_module_without_attention() -> None:
    assert all(run_distributed(_refuses_modules_without_attention, 2))


def test_cp_split_qwen3_matches_the_whole_model() -> None:
    for rank, differences in enumerate(run_distributed(_qwen3_parity, 2)):
        for name, difference in differences.items():
            assert difference <= TOLERANCE, f"rank {rank}: {name} differs by {difference:.3g}"
