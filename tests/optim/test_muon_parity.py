"""Muon over sharded parameters against one process (fp32, gloo, 2 ranks, one launch).

Tiny Qwen3 under its own plan at dp_shard=2 (FSDP2 ``Shard(0)``) and at tp=2 (``Shard(0)``/``Shard(1)`` and
replicated norms), tiny Qwen3-MoE at ep=2 (each rank 4 of the 8 experts) and ``transformers``' tiny Qwen3-MoE at
ep=2 under the adapter's plan (each rank 2 of the 4 experts), 6 steps of the same batches (each data rank its
half), parameters within 1e-5 of one process; a training checkpoint saved after 3 steps at dp_shard=2 and loaded
into a fresh model and optimizer continues exactly as the uninterrupted run; expert stacks ``[E, in, out]`` split
over their experts (no gather) or over a matrix dimension (gathered) take one process's per-expert steps. On every
layout the memory plan's optimizer bytes equal the state each rank holds.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from tiny_hf import VOCAB, tiny_causal_lm
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.modules.loss import causal_lm_loss
from lightning_d9d.optim import Muon, muon_param_groups
from lightning_d9d.plans import ParallelOptions, maybe_loss_parallel
from lightning_d9d.plans.memory import optimizer_states_per_parameter, plan_memory
from lightning_d9d.state.training import load, optimizer_state, save

STEPS, SAVED_AT = 6, 3
LAYOUTS = {"dp_shard2": {"dp_shard": 2}, "tp2": {"tp": 2}, "moe_ep2": {"ep": 2}}
OPTIONS = {"lr": 1e-2, "weight_decay": 0.1}


def full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def batches(vocab: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, vocab, (2, 8), generator=generator),
            torch.randint(0, vocab, (2, 8), generator=generator),
        )
        for _ in range(STEPS)
    ]


def new_model(moe: bool) -> nn.Module:
    """Tiny Qwen3, or tiny Qwen3-MoE without its load-balancing loss (each rank would weigh its own tokens)."""
    return (
        Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(router_aux_loss_coef=0.0))
        if moe
        else Qwen3ForCausalLM(Qwen3Config.tiny())
    )


def sharded_model(dims: ParallelDims, seed: int) -> Any:
    with torch.device("meta"):
        model: Any = new_model(dims.ep > 1)
    model.parallelize(dims, ParallelOptions())
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def train(
    model: nn.Module, optimizer: Muon, dims: ParallelDims | None, steps: range, vocab: int = 256
) -> None:
    """Steps ``steps`` of :func:`batches`: one process takes the whole batch, a data rank its rows (FSDP
    averages the gradients: every row has as many tokens). A ``transformers`` model's output gives its logits."""
    data = batches(vocab)
    for step in steps:
        ids, labels = data[step]
        if dims is not None:
            rank, dp = dims.mesh_for("dp").get_local_rank(), dims.dp
            rows = slice(rank * 2 // dp, (rank + 1) * 2 // dp)
            ids, labels = ids[rows], labels[rows]
        with maybe_loss_parallel(dims is not None and dims.tp > 1):
            output = model(ids)
            causal_lm_loss(getattr(output, "logits", output), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def largest_difference(model: nn.Module, reference: nn.Module) -> float:
    expected = dict(reference.named_parameters())
    return max(
        float((full(p.detach()) - full(expected[n].detach())).abs().max())
        for n, p in model.named_parameters()
    )


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (local shards), the scalar step counters left out as the plan does."""
    tensors = [value for state in optimizer.state.values() for value in state.values() if value.ndim > 0]
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def planned_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    states = optimizer_states_per_parameter(optimizer)
    return plan_memory(model.parameters(), optimizer_states=states, config=None, activations=None).optimizer


def layout_body(layout: dict[str, int], directory: str) -> dict[str, float | int | None]:
    dims = ParallelDims(**layout).resolve(dist.get_world_size()).build_mesh("cpu")
    reference: Any = new_model(dims.ep > 1)
    reference.init_weights(seed=11)
    reference_optimizer = Muon(muon_param_groups(reference), **OPTIONS)
    train(reference, reference_optimizer, None, range(STEPS))

    model = sharded_model(dims, seed=11)
    optimizer = Muon(muon_param_groups(model), **OPTIONS)
    train(model, optimizer, dims, range(SAVED_AT))
    result: dict[str, float | int | None] = {}
    if layout == LAYOUTS["dp_shard2"]:
        checkpoint = Path(directory) / "step=3.ckpt"
        save(
            checkpoint,
            {
                "state_dict": get_model_state_dict(model),
                "optimizer_states": [optimizer_state(model, optimizer)],
            },
        )
        resumed = sharded_model(dims, seed=12)  # other weights: the load must replace them
        resumed_optimizer = Muon(muon_param_groups(resumed), **OPTIONS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(checkpoint, resumed, {0: resumed_optimizer}, strict=True, weights_only=True)
        train(resumed, resumed_optimizer, dims, range(SAVED_AT, STEPS))
    train(model, optimizer, dims, range(SAVED_AT, STEPS))
    result["difference"] = largest_difference(model, reference)
    result["held_state_bytes"] = held_state_bytes(optimizer)
    result["planned_state_bytes"] = planned_state_bytes(model, optimizer)
    if layout == LAYOUTS["dp_shard2"]:
        result["resume_difference"] = largest_difference(resumed, model)
    return result


def experts_body() -> dict[str, float]:
    """A stack of 4 experts ``[4, 32, 16]`` split over 2 ranks by experts (``Shard(0)``, what ep does) and by
    rows (``Shard(1)``), 3 steps of the same gradients against one process."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(4, 32, 16, generator=generator)
    grads = [torch.randn(4, 32, 16, generator=generator) for _ in range(3)]
    reference = nn.Parameter(start.clone())
    sharded = {dim: nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(dim)])) for dim in (0, 1)}
    optimizers = [Muon([reference], **OPTIONS), *(Muon([param], **OPTIONS) for param in sharded.values())]
    for grad in grads:
        reference.grad = grad.clone()
        for dim, param in sharded.items():
            param.grad = distribute_tensor(grad.clone(), mesh, [Shard(dim)])
        for optimizer in optimizers:
            optimizer.step()
    return {
        f"shard{dim}": float((param.full_tensor() - reference).abs().max()) for dim, param in sharded.items()
    }


def transformers_moe_body() -> dict[str, float | int | None]:
    """``transformers``' tiny Qwen3-MoE under the adapter's plan at ep=2 (its stacked experts, each rank 2 of
    the 4), against the same model in one process."""
    reference = tiny_causal_lm("qwen3_moe")
    train(reference, Muon(muon_param_groups(reference), **OPTIONS), None, range(STEPS), VOCAB)
    dims = ParallelDims(ep=2).resolve(dist.get_world_size()).build_mesh("cpu")
    model = tiny_causal_lm("qwen3_moe")
    parallelize_hf(model, dims, ParallelOptions())
    optimizer = Muon(muon_param_groups(model), **OPTIONS)
    train(model, optimizer, dims, range(STEPS), VOCAB)
    experts = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    return {
        "difference": largest_difference(model, reference),
        "expert_shards": experts.to_local().shape[0] if isinstance(experts, DTensor) else 0,
        "muon_params": len(muon_param_groups(model)[0]["params"]),
        "held_state_bytes": held_state_bytes(optimizer),
        "planned_state_bytes": planned_state_bytes(model, optimizer),
    }


def all_bodies(directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    results: dict[str, Any] = {name: layout_body(layout, directory) for name, layout in LAYOUTS.items()}
    results["hf_moe_ep2"] = transformers_moe_body()
    results["experts"] = experts_body()
    return results


@functools.cache
def ranks(directory: str) -> list[dict[str, Any]]:
    return run_distributed(all_bodies, 2, directory)


def test_sharded_muon_matches_one_process(tmp_path_factory: Any) -> None:
    for rank in ranks(str(tmp_path_factory.getbasetemp())):
        for name in LAYOUTS:
            assert rank[name]["difference"] <= 1e-5, name
            # the memory plan counts a momentum buffer per Muon matrix, two moments per AdamW parameter
            assert rank[name]["planned_state_bytes"] == rank[name]["held_state_bytes"], name
        assert rank["dp_shard2"]["resume_difference"] == 0.0
        hf = rank["hf_moe_ep2"]
        assert hf["difference"] <= 1e-5
        assert hf["expert_shards"] == 2  # 2 of the 4 experts on each rank
        assert hf["muon_params"] == 2 * 6  # per layer: q, k, v, o and the two expert stacks
        assert hf["planned_state_bytes"] == hf["held_state_bytes"]
        assert rank["experts"]["shard0"] <= 1e-6
        assert rank["experts"]["shard1"] <= 1e-6
