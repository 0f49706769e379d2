"""A transformers MoE model's experts without ep: the adapter runs them through its own forward (a local
dispatcher, the grouped GEMM registry) wherever a CPU probe finds that forward exact, so that a compiled block over
fp32 weights (``fsdp_on_one_rank=False``: the setting CUDA graphs need) runs the grouped GEMM on the device
instead of ``transformers``' fallback, a host loop over the experts. ``$LIGHTNING_D9D_HF_KERNELS=0`` keeps
``transformers``' forward; a class whose forward computes otherwise keeps it too, and is refused under ep. The
trained runs (dp_shard, tp, cp, pp, FP8 with these experts) against one process of the unmodified model:
test_hf_trainer.py, test_hf_layout_runs.py and the other parity files."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from tiny_hf import VOCAB, tiny_causal_lm

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf.config_plans import expert_modules
from lightning_d9d.models.hf.expert import check_hf_expert_model, parallelize_hf_experts
from lightning_d9d.modules.moe import LocalDispatcher
from lightning_d9d.plans.options import ParallelOptions

IDS = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(7))
ONE_RANK = ParallelDims(dp_shard=1).resolve(1)


def local_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return parallelize_hf_experts(model, ONE_RANK, ParallelOptions())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_without_ep_the_experts_run_ours_with_the_model_s_numbers(family: str) -> None:
    reference = tiny_causal_lm(family)
    model = tiny_causal_lm(family)
    changed = local_experts(model)
    assert changed and changed == list(expert_modules(model).values())
    assert all(isinstance(experts._d9d_dispatcher, LocalDispatcher) for experts in changed)
    assert all("forward" in vars(experts) for experts in changed)
    expected, got = reference(input_ids=IDS, labels=IDS), model(input_ids=IDS, labels=IDS)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    expected.loss.backward()
    got.loss.backward()
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None and theirs[name].grad is not None, name
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_hf_kernels_off_keeps_transformers_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_HF_KERNELS", "0")
    model = tiny_causal_lm("qwen3_moe")
    assert local_experts(model) == []
    assert not any("forward" in vars(experts) for experts in expert_modules(model).values())


class GateUpSwapped(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts):  # type: ignore[misc]
    """Stacked experts under the same names whose gate is the second half: the layout checks cannot tell."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> Any:
        output = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            for expert in range(self.gate_up_proj.shape[0]):
                rows = top_k_index[:, slot] == expert
                up, gate = (hidden_states[rows] @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
                out = (self.act_fn(gate) * up) @ self.down_proj[expert].T
                output[rows] += out * top_k_weights[rows, slot, None]
        return output


def with_swapped_gate(model: torch.nn.Module) -> torch.nn.Module:
    for experts in expert_modules(model).values():
        experts.__class__ = GateUpSwapped
    return model


def test_experts_that_compute_otherwise_keep_their_forward_and_are_refused_under_ep(caplog: Any) -> None:
    model = with_swapped_gate(tiny_causal_lm("qwen3_moe"))
    with caplog.at_level("INFO", logger="lightning_d9d.models.hf"):
        assert local_experts(model) == []
    assert not any("forward" in vars(experts) for experts in expert_modules(model).values())
    assert "keeps transformers' experts forward: it has a forward that computes otherwise" in caplog.text
    with pytest.raises(NotImplementedError, match=r"ep=2: .*GateUpSwapped.*computes otherwise.*use ep=1"):
        check_hf_expert_model(model, 2)


def test_the_probe_does_not_ask_the_registry(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The probe runs the reference grouped GEMM: a CUDA-only backend named in the environment (read on a GPU
    machine at plan time) must not fail it, which would keep transformers' forward and refuse ep; nor may the
    probe announce a backend the run will not use."""
    from lightning_d9d.kernels import grouped_gemm
    from lightning_d9d.models.hf import expert

    monkeypatch.setattr(expert, "_PROBED", {})  # probed afresh, not read from an earlier test's finding
    monkeypatch.setattr(grouped_gemm._REGISTRY, "announced", set())
    monkeypatch.setenv("LIGHTNING_D9D_GROUPED_GEMM", "grouped_gemm")  # bf16 on CUDA only
    model = tiny_causal_lm("qwen3_moe")
    with caplog.at_level("INFO", logger="lightning_d9d.kernels"):
        assert local_experts(model) == list(expert_modules(model).values())
    check_hf_expert_model(model, 2)
    assert "grouped GEMM backend" not in caplog.text


def test_experts_with_a_forward_of_their_own_keep_it() -> None:
    model = tiny_causal_lm("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    own = experts.forward

    def users(*args: Any) -> Any:  # e.g. a user's wrapper around the class's forward
        return own(*args)

    experts.forward = users
    assert local_experts(model) == [model.model.layers[1].mlp.experts]
    assert vars(experts)["forward"] is users
    with pytest.raises(NotImplementedError, match="a forward of its own on the instance"):
        check_hf_expert_model(model, 2)


def test_a_compiled_block_over_fp32_weights_keeps_the_grouped_gemm_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 autocast over fp32 weights (one GPU without FSDP's bf16 copies) in a compiled MoE block: the experts'
    products are torch's grouped GEMM in bf16 and no operator of the forward or backward graph reads the device on
    the host (what ``reduce-overhead`` records). ``transformers``' own forward, traced so, calls
    ``transformers::grouped_mm_fallback`` (a loop over ``offs.tolist()`` in fp32) in both graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    monkeypatch.setenv(
        "LIGHTNING_D9D_GROUPED_GEMM", "torch"
    )  # auto's choice on a Hopper GPU; CPU runs it too
    model = tiny_causal_lm("qwen3_moe", layers=1)
    local_experts(model)
    block = model.model.layers[0].mlp
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.float().sum().backward()
    assert len(graphs) == 2  # one forward, one backward: no graph break
    targets = [
        str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"
    ]
    assert not [t for t in targets if t.startswith("transformers.")], targets
    assert targets.count("aten._grouped_mm.default") >= 2 + 3  # forward's two products, backward's gradients
    assert [get_first_incompatible_cudagraph_node(graph) for graph in graphs] == [None, None]
    assert block.experts.gate_up_proj.grad is not None
