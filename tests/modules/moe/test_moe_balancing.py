"""Auxiliary-loss-free bias update: the sign rule by hand, the load summed over micro-steps, and over 2 gloo
ranks equal to one process on the concatenated tokens."""

from __future__ import annotations

import inspect
import itertools
import typing

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_d9d.callbacks.moe import routers_by_layer
from lightning_d9d.models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.modules.moe import TopKRouter, routers_in, update_expert_bias
from lightning_d9d.plans.checkpointing import CheckpointingKind, apply_activation_checkpointing

HIDDEN, EXPERTS, TOP_K, RATE, STEPS = 6, 5, 2, 0.05, 4


def _router() -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(HIDDEN, EXPERTS, TOP_K, selection_bias=True)
    with torch.no_grad():
        router.weight.mul_(0.1)  # small logits: the bias soon changes the choices
    return router


def _batches() -> list[torch.Tensor]:
    """Per optimizer step: 4 micro-batches of uneven size (2 per rank when 2 ranks)."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(29, HIDDEN, generator=generator) for _ in range(STEPS)]


def _micro_batches(step_tokens: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    pieces = step_tokens.split([5, 9, 8, 7])  # 4 micro-batches, 2 per rank on 2 ranks
    mine = pieces[rank::world] if world > 1 else pieces
    return list(mine)


def _train(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    router = _router()
    group = dist.group.WORLD if world > 1 else None
    biases, loads = [], []
    for step_tokens in _batches():
        for micro in _micro_batches(step_tokens, rank, world):
            router(micro)
        loads.append(update_expert_bias(routers_in(router), RATE, group)[0].clone())
        assert router.expert_bias is not None
        biases.append(router.expert_bias.clone())
    return biases, loads


def _on_rank() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _train(dist.get_rank(), dist.get_world_size())


def test_sign_rule_by_hand() -> None:
    router = TopKRouter(2, 4, 1, selection_bias=True)
    plain = TopKRouter(2, 4, 1)
    router.expert_load.copy_(torch.tensor([3, 1, 2, 2]))  # mean 2
    plain.expert_load.copy_(torch.tensor([1, 1, 4, 0]))
    loads = update_expert_bias([router, plain], rate=0.5)
    assert router.expert_bias is not None
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert loads.tolist() == [[3, 1, 2, 2], [1, 1, 4, 0]]
    assert int(router.expert_load.abs().sum()) == 0 and int(plain.expert_load.abs().sum()) == 0


def test_load_of_micro_steps_equals_one_pass_over_their_tokens() -> None:
    accumulated, whole = _router(), _router()
    step_tokens = _batches()[0]
    for micro in step_tokens.split([5, 9, 8, 7]):
        accumulated(micro)
    whole(step_tokens)
    assert torch.equal(accumulated.expert_load, whole.expert_load)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["full", "selective"])
def test_a_checkpointed_forward_is_counted_once(kind: CheckpointingKind, compiled: bool) -> None:
    """Activation checkpointing runs the blocks' forward again inside backward; that recompute must not add to
    the load (it doubled every count: the logged loads read twice the tokens routed)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig.tiny()
    plain, checkpointed = Qwen3MoeForCausalLM(config), Qwen3MoeForCausalLM(config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed.model.layers, kind=kind)
    if compiled:
        # dynamo + AOTAutograd, as compile=True traces the blocks (without Inductor's code generation)
        for layer in checkpointed.model.layers.values():
            layer.compile(backend="aot_eager")
    ids = torch.randint(0, config.vocab_size, (2, 16))
    for model in (plain, checkpointed):
        model.train()
        model(ids).float().mean().backward()
    loads = [[router.expert_load.clone() for router in routers_in(model)] for model in (plain, checkpointed)]
    assert [int(load.sum()) for load in loads[0]] == [2 * 16 * config.num_experts_per_tok] * 2
    assert all(torch.equal(a, b) for a, b in zip(*loads, strict=True))


def test_two_ranks_equal_one_process_on_all_tokens() -> None:
    single_biases, single_loads = _train(0, 1)
    # The bias moves every step (and the choices with it, so later steps depend on earlier updates).
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(single_biases))
    results = run_distributed(_on_rank, 2)
    assert len(results) == 2
    for rank_biases, rank_loads in results:
        for step in range(STEPS):
            assert torch.equal(rank_loads[step], single_loads[step]), step
            torch.testing.assert_close(rank_biases[step], single_biases[step], atol=1e-6, rtol=0)


def _protocol_check_of_python_312(cls: type, instance: object) -> bool:
    """``isinstance(instance, cls)`` for a runtime-checkable protocol as Python 3.12 and newer decide it: every
    member looked up with ``inspect.getattr_static``, which does not call ``nn.Module.__getattr__`` (this
    machine's Python is 3.11, whose ``hasattr`` does)."""
    if not getattr(cls, "_is_protocol", False) or not getattr(cls, "_is_runtime_protocol", False):
        return type.__instancecheck__(cls, instance)
    missing = object()
    members = typing._get_protocol_attrs(cls)  # type: ignore[attr-defined]
    return all(inspect.getattr_static(instance, name, missing) is not missing for name in members)


def test_routers_are_found_under_the_protocol_check_of_python_312(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routers keep ``expert_load`` / ``expert_bias`` as buffers. On Python 3.12 an ``isinstance`` against the
    protocol found none (seen on a Python 3.12: biases never moved, the counters never reset, both left as
    ``to_empty`` made them); the routers are found by their members instead."""
    monkeypatch.setattr(type(typing.Protocol), "__instancecheck__", _protocol_check_of_python_312)
    config = Qwen3MoeConfig.tiny(router_selection_bias=True)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model.to_empty(device="cpu")
    routers = routers_in(model)
    assert len(routers) == len(config.sparse_layers) == 2
    for router in routers:
        assert router.expert_bias is not None
        router.expert_load.fill_(7)  # what the allocation held
        router.expert_bias.fill_(float("nan"))
    model.init_weights(seed=0)
    assert all(
        not r.expert_load.any() and r.expert_bias is not None and not r.expert_bias.any() for r in routers
    )
    assert len(routers_by_layer(model)) == 2
