"""``model_loss(..., causal_lm_loss)`` on a transformers causal LM: the LM head fused with the cross-entropy
(:mod:`lightning_d9d.models.hf.loss`) gives the logits path's loss and gradients (fp32, 1e-5) without a
``[tokens, vocab]`` tensor, on one process and under 2-process FSDP; heads that are not a plain linear layer, and
inputs the fused path does not take, keep the logits path."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import tiny_hf
import torch
import torch.distributed as dist
import transformers
from distributed import run_distributed
from test_hf_tensor_parallel import VOCAB, tiny_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_d9d.loss import fused_causal_lm_loss
from lightning_d9d.mesh import ParallelDims
from lightning_d9d.models.hf import loss as hf_loss
from lightning_d9d.models.hf import parallelize_hf
from lightning_d9d.modules.loss import CausalLMLoss, causal_lm_loss
from lightning_d9d.plans import ParallelOptions

ROWS, SEQ = 4, 12
# the module (the package exports its function under the same name)
lce = importlib.import_module("lightning_d9d.kernels.linear_cross_entropy")


def padded_batch(seed: int = 0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded unevenly (a row with no label at all among them)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    for row, kept in enumerate((SEQ, 7, 0, 3)):
        labels[row, kept:] = ignore_index
    return ids, labels


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def loss_and_grads(model: nn.Module, loss: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss.backward()
    grads = {name: full(p.grad).detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def assert_same(fused: tuple[float, dict], logits: tuple[float, dict]) -> None:
    assert abs(fused[0] - logits[0]) <= 1e-5
    assert set(fused[1]) == set(logits[1])
    for name, grad in logits[1].items():
        assert float(grad.abs().max()) > 0, name  # every parameter is reached
        assert float((fused[1][name] - grad).abs().max()) <= 1e-5, name


@pytest.mark.parametrize(
    ("family", "tied"),
    # Gemma 3: its soft cap None (the default), so its forward's capping branch does not run
    [("qwen3", True), ("qwen3", False), ("llama", False), ("gemma3", False)],
)
def test_fused_equals_logits_path(family: str, tied: bool) -> None:
    model = tiny_model(family, tied)
    model.fuse_head_loss = True
    ids, labels = padded_batch(ignore_index=7)
    loss_fn = CausalLMLoss(ignore_index=7)  # a custom ignore_index reaches the fused path
    calls = []
    original = hf_loss.linear_cross_entropy

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs["ignore_index"])
        return original(*args, **kwargs)

    hf_loss.linear_cross_entropy = counted
    try:
        fused = fused_causal_lm_loss(model, (ids,), labels, loss_fn)
    finally:
        hf_loss.linear_cross_entropy = original
    assert fused is not None and calls == [7]
    expected = loss_and_grads(model, loss_fn(model(ids), labels))  # the output object: its .logits
    assert_same(loss_and_grads(model, fused), expected)
    # with an attention mask (passed on to the base model as model(ids, mask) does)
    mask = torch.ones_like(ids)
    mask[3, 9:] = 0
    fused = fused_causal_lm_loss(model, (ids, mask), labels, loss_fn)
    assert fused is not None
    assert_same(loss_and_grads(model, fused), loss_and_grads(model, loss_fn(model(ids, mask), labels)))


def test_the_loss_reads_an_outputs_logits() -> None:
    model = tiny_model("qwen3", False)
    ids, labels = padded_batch()
    output = model(ids)
    assert torch.equal(causal_lm_loss(output, labels), causal_lm_loss(output.logits, labels))
    with pytest.raises(TypeError, match=r"a model output with \.logits, got dict"):
        causal_lm_loss({"logits": output.logits}, labels)


class LargestLogits(TorchDispatchMode):
    """The most tokens of any op output whose last dim is the vocabulary (forward and backward)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.tokens = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.ndim >= 2 and tensor.shape[-1] == self.vocab:
                self.tokens = max(self.tokens, tensor.numel() // self.vocab)
        return out


def test_no_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, rows, seq = 384, 2, 160  # no other dim of the model is 384
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    ids = torch.randint(0, vocab, (rows, seq))
    labels = torch.randint(0, vocab, (rows, seq))
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")  # the switch our models use (CPU: off by default)
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 128 * vocab)  # chunks of at most 128 of the 320 tokens
    with LargestLogits(vocab) as fused_mode:
        fused = fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss)
        assert fused is not None
        fused.backward()
    with LargestLogits(vocab) as logits_mode:
        causal_lm_loss(model(ids), labels).backward()
    assert logits_mode.tokens == rows * seq  # the mode sees the logits path's [tokens, vocab]
    assert 0 < fused_mode.tokens <= 128


def test_fused_only_where_it_is_the_same_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen3", False)
    ids, labels = padded_batch()
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None  # CPU: off by default
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is not None
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss, tensor_parallel=True) is None
    assert fused_causal_lm_loss(model, (ids,), labels, lambda o, t: causal_lm_loss(o, t)) is None
    # inputs the base model does not take, or that change the logits: labels, logits_to_keep, a cache
    assert fused_causal_lm_loss(model, (ids, None, None, None, None, labels), labels, causal_lm_loss) is None
    assert hf_loss.decoder_inputs(model, (ids, None, None, None, None, None, None, 1)) is None
    model.fuse_head_loss = False
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None
    model.fuse_head_loss = None
    # a family that soft-caps its logits by a config field
    model.config.final_logit_softcapping = 30.0
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None
    model.config.final_logit_softcapping = None
    assert hf_loss.plain_head(model) is model.lm_head
    # a head with a bias
    model.lm_head.bias = nn.Parameter(torch.zeros(VOCAB))
    assert hf_loss.plain_head(model) is None


class ScaledQwen3(transformers.Qwen3ForCausalLM):
    """Scales its logits after the head, as Granite and Cohere do."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:  # type: ignore[override]
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits / 2.0
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


class NormedQwen3(transformers.Qwen3ForCausalLM):
    """Changes the hidden states before the head."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:  # type: ignore[override]
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state * 0.5
        logits = self.lm_head(hidden_states)
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("Qwen3ForCausalLM", True),
        ("LlamaForCausalLM", True),
        ("MistralForCausalLM", True),
        ("Qwen2ForCausalLM", True),
        ("Qwen3MoeForCausalLM", True),
        ("Gemma2ForCausalLM", False),  # final_logit_softcapping
        ("GraniteForCausalLM", False),  # logits / logits_scaling
        ("CohereForCausalLM", False),  # logits * logit_scale
    ],
)
def test_the_forward_says_whether_the_head_is_plain(name: str, plain: bool) -> None:
    model_class = getattr(transformers, name)
    assert (hf_loss._head_attribute(model_class, "model") == "lm_head") is plain


@pytest.mark.parametrize(
    ("family", "overrides", "fields"),
    [
        ("gemma2", {"final_logit_softcapping": 2.0}, ("final_logit_softcapping",)),  # / cap, tanh, * cap
        ("gemma3", {"final_logit_softcapping": 2.0}, ("final_logit_softcapping",)),
        ("granite", {"logits_scaling": 4.0}, ("logits_scaling",)),  # logits / logits_scaling
        ("cohere", {}, ("logit_scale",)),  # logits * self.logit_scale (0.0625 by default)
        ("qwen3", {}, ()),  # a plain head: no step
    ],
)
def test_the_logit_steps_give_the_forwards_logits(family: str, overrides: dict, fields: tuple) -> None:
    """What a pipeline's last stage runs after the head (``logit_steps``, read from the forward) gives the
    forward's own logits bit for bit."""
    model = tiny_hf.tiny_causal_lm(family, **overrides)
    steps = hf_loss.logit_steps(model)
    assert steps is not None and steps.fields == fields
    ids, _ = padded_batch()
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        expected = model(input_ids=ids).logits
        assert torch.equal(steps(model.lm_head(hidden)), expected)
        assert torch.equal(model.lm_head(hidden), expected) is not bool(fields)  # the steps change the logits


def test_a_step_on_a_tensor_or_a_call_is_not_repeated() -> None:
    assert hf_loss.logit_steps(ScaledQwen3(tiny_model("qwen3", False).config)) is not None  # logits / 2.0
    assert (
        hf_loss.logit_steps(NormedQwen3(tiny_model("qwen3", False).config)) is None
    )  # hidden states changed


@pytest.mark.parametrize("model_class", [ScaledQwen3, NormedQwen3])
def test_a_changed_head_keeps_the_logits_path(model_class: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_FUSED_LOSS", "1")
    model = model_class(tiny_model("qwen3", False).config)
    ids, labels = padded_batch()
    assert fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss) is None


def fsdp_body(family: str, tied: bool) -> dict[str, Any]:
    model = tiny_model(family, tied)
    model.fuse_head_loss = True
    dims = ParallelDims(dp_shard=2).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize_hf(model, dims, ParallelOptions())
    assert isinstance(model, FSDPModule)
    rank = dist.get_rank()
    ids, labels = padded_batch(seed=rank)  # other rows (and padding) per rank
    fused = fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss)
    assert fused is not None
    got = loss_and_grads(model, fused)  # gradients averaged over the ranks by FSDP
    got_again = loss_and_grads(model, fused_causal_lm_loss(model, (ids,), labels, causal_lm_loss))
    expected = loss_and_grads(model, causal_lm_loss(model(ids), labels))
    return {"fused": got, "again": got_again, "logits": expected}


@pytest.mark.parametrize(("family", "tied"), [("qwen3", True), ("llama", False)])
def test_fused_under_fsdp_equals_logits_path(family: str, tied: bool) -> None:
    ranks = run_distributed(fsdp_body, 2, family, tied)
    for result in ranks:
        assert_same(result["fused"], result["logits"])
        assert_same(result["again"], result["logits"])
    assert ranks[0]["logits"][0] != ranks[1]["logits"][0]  # the ranks held other tokens
