"""Two ranks, one GPU each (``torchrun --nproc-per-node 2``): the DeepEP dispatcher against the all-to-all one.

The same MoE block (bf16, experts split over the two ranks), the same tokens (each rank its own count, some
experts chosen by no token): output, input gradient, router and expert gradients through DeepEP's dispatch and
combine against those through ``all_to_all_single``; then both dispatchers' dispatch + combine time at the MoE
benchmark's shape. Rank 0 prints one JSON line. Launched by ``tests/gpu/test_deepep_gpu.py``.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

from lightning_d9d.modules.moe import AllToAllDispatcher, DeepEPDispatcher, MoE
from lightning_d9d.modules.moe.deepep import new_deep_ep_buffer

EXPERTS, TOP_K, HIDDEN, FFN = 64, 8, 1024, 384
UNCHOSEN = (5, 40, 41)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def block_on(rank: int, world: int, dispatcher: object) -> MoE:
    torch.manual_seed(0)
    block = MoE(HIDDEN, EXPERTS, TOP_K, FFN, normalize_top_k=True, selection_bias=True).cuda()
    assert block.gate.expert_bias is not None
    block.gate.expert_bias[list(UNCHOSEN)] = -1e3  # these experts get no token
    local = EXPERTS // world
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(block.experts, name).detach()
        setattr(block.experts, name, torch.nn.Parameter(full[rank * local : (rank + 1) * local].bfloat16()))
    block.gate.weight.data = block.gate.weight.data.bfloat16()
    block.dispatcher = dispatcher  # type: ignore[assignment]
    return block


def run(block: MoE, hidden: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    x = hidden.clone().requires_grad_(True)
    out = block(x)
    (out.float() * probe).sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters() if p.grad is not None}
    return {"output": out.detach(), "input grad": x.grad, **grads}  # type: ignore[dict-item]


def timed(dispatcher: object, hidden: torch.Tensor, block: MoE, iters: int = 20) -> float:
    routing = block.gate(hidden)
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dispatched = dispatcher.dispatch(hidden, routing)  # type: ignore[attr-defined]
        dispatcher.combine(dispatched.tokens, dispatched)  # type: ignore[attr-defined]
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    generator = torch.Generator(device="cuda").manual_seed(100 + rank)
    count = 3000 + 1000 * rank  # uneven over the ranks
    hidden = torch.randn(count, HIDDEN, device="cuda", generator=generator).bfloat16()
    probe = torch.randn(count, HIDDEN, device="cuda", generator=generator)
    all_to_all = AllToAllDispatcher(group, EXPERTS)
    deepep = DeepEPDispatcher(new_deep_ep_buffer(group), EXPERTS)
    expected = run(block_on(rank, world, all_to_all), hidden, probe)
    actual = run(block_on(rank, world, deepep), hidden, probe)
    errors = {name: relative(actual[name], expected[name]) for name in expected}
    shape_tokens = 16384
    big = torch.randn(shape_tokens, HIDDEN, device="cuda", generator=generator).bfloat16()
    timing_block = block_on(rank, world, all_to_all)
    with torch.no_grad():
        milliseconds = {
            "all_to_all": timed(all_to_all, big, timing_block),
            "deepep": timed(deepep, big, timing_block),
        }
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, {"errors": errors, "dispatch_combine_ms": milliseconds})
    if rank == 0:
        print(json.dumps({"ranks": gathered, "tokens_per_rank_timed": shape_tokens}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
