"""What every decoder-only causal LM of ours shares, whatever its blocks: the tied LM head, the pipeline cut, and
the LM head fused with its loss (with and without pipeline stages).

A model keeps ``self.model`` (with ``embed_tokens``, a ``layers`` ModuleDict keyed by layer number, ``norm``),
``self.lm_head`` and ``self.config.tie_word_embeddings``; its own file holds its config, blocks and plan.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from typing_extensions import Self

from lightning_d9d.kernels.linear_cross_entropy import linear_cross_entropy
from lightning_d9d.modules.hf_init import is_transformers_model
from lightning_d9d.modules.inputs import ModelInputs
from lightning_d9d.modules.loss import CausalLMLoss

FUSED_LOSS_ENV = "LIGHTNING_D9D_FUSED_LOSS"
log = logging.getLogger("lightning_d9d.models")
_ANNOUNCED: set[str] = set()
_FSDP_REGISTERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class CausalLM(nn.Module):
    """Base of the causal LMs: ties the head to the embedding and drops what a pipeline rank does not hold."""

    config: Any
    model: Any  # the decoder: embed_tokens, layers (ModuleDict), norm
    lm_head: nn.Linear | None
    # Whether the strategy's ``model_loss`` with ``causal_lm_loss`` calls :meth:`forward_loss` (head and loss
    # fused, no [tokens, vocab] logits) instead of ``forward`` then the loss. None: on CUDA, where the logits'
    # memory matters (on CPU the logits path keeps results bitwise equal to a plain loop), unless
    # $LIGHTNING_D9D_FUSED_LOSS=1 / 0 says otherwise.
    fuse_head_loss: bool | None = None

    def _build(self, config: Any, decoder: Callable[[], nn.Module]) -> None:
        """Hold ``config``, the decoder ``decoder()`` builds and a bias-free head over the vocabulary (tied to the
        embedding when the config says so). Always built on meta: the per-module default inits (kaiming for
        every Linear) would only be overwritten by :meth:`init_weights`, and cost a quarter of the time of
        building a real model on CPU; built outside ``torch.device("meta")`` the model is then given memory and
        initialised from ``torch.initial_seed()``."""
        self.config = config
        device = torch.get_default_device()
        with torch.device("meta"):
            self.model = decoder()
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define init_weights(seed)")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in the compute dtype (the loss upcasts: see :func:`~lightning_d9d.modules.causal_lm_loss`); a
        pipeline stage without the head returns its hidden states. Router losses of an MoE model ride on the
        logits' backward in training mode."""
        hidden = self.model(input_ids, position_ids)
        return self.lm_head(hidden) if self.lm_head is not None else hidden

    def forward_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """``causal_lm_loss(self(input_ids), labels)`` without materialising the logits: the mean cross-entropy
        over the labels that are not ``ignore_index``, computed from the final hidden states chunk by chunk
        (:func:`~lightning_d9d.kernels.linear_cross_entropy`). Under FSDP call it through
        :func:`fused_causal_lm_loss`, which registers it as a forward method (so the head is unsharded)."""
        if self.lm_head is None:
            raise ValueError(
                f"{type(self).__name__}.forward_loss needs the LM head; this pipeline stage does not hold it"
            )
        return head_loss(self.model(input_ids, position_ids), self.lm_head, labels, ignore_index)

    def _tie_weights(self) -> None:
        head, embedding = self.lm_head, self.model.embed_tokens
        tied = self.config.tie_word_embeddings and head is not None and embedding is not None
        if tied and head.weight is not embedding.weight:  # type: ignore[union-attr]
            head.weight = embedding.weight  # type: ignore[union-attr]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # ``to_empty`` from meta (and any conversion that cannot reuse the tensor in place) registers a new
        # Parameter per module, which would silently untie the head from the embedding. DTensor parameters
        # (after fully_shard) are swapped in place and stay tied; then this is a no-op.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    # ------------------------------------------------------------------------------------------ pipeline
    @property
    def num_pipeline_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def pipeline_keep(self, layer_ids: Sequence[int], *, first: bool, last: bool) -> None:
        """Drop, in place, every layer but ``layer_ids``, and the embedding / norm and head unless this rank
        holds the first / last stage (see :class:`~lightning_d9d.pipeline.PipelineSplittable`)."""
        if self.config.tie_word_embeddings and not (first and last):
            raise ValueError(
                f"{type(self).__name__}: tie_word_embeddings=True cannot be split over pipeline stages on "
                "different ranks (the embedding and the head would be two copies); set tie_word_embeddings=False "
                "or pp=1"
            )
        keep = {str(i) for i in layer_ids}
        for key in [key for key in self.model.layers if key not in keep]:
            del self.model.layers[key]
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
            self.lm_head = None


class CausalLMStage(nn.Module):
    """Base of a causal LM's pipeline stages: the last one ends in the LM head, or, handed the microbatch's
    ``labels`` (the strategy does when :func:`fused_loss_ignore_index` says so), in the head's loss computed
    without logits. The loss is then computed inside the stage's forward, where FSDP has gathered the head."""

    lm_head: nn.Linear | None

    def head(
        self, hidden: torch.Tensor, labels: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        """Hidden states (not the last stage), logits, or with ``labels`` the mean loss over them."""
        if self.lm_head is None:
            return hidden  # a stage before the last (labels reach every stage of the rank that holds it)
        if labels is None:
            return self.lm_head(hidden)
        return head_loss(hidden, self.lm_head, labels, ignore_index)


def head_loss(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """``CausalLMLoss(ignore_index)(lm_head(hidden), labels)`` without the logits: the one computation of the
    fused path, with and without pipeline stages."""
    return linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=ignore_index)


def fused_loss_ignore_index(
    model: nn.Module, loss_fn: object, *, tensor_parallel: bool = False
) -> int | None:
    """The ``ignore_index`` to compute ``loss_fn`` with the head fused in (``loss_fn`` is a plain
    :class:`~lightning_d9d.modules.loss.CausalLMLoss`, ``model`` a :class:`CausalLM`, fusion not switched off);
    None where the caller must run the logits path.

    Under tensor parallelism the head's logits stay vocabulary-sharded and torch's loss parallel computes the
    cross-entropy on the shards: that path is kept (logged once). The pipeline schedule asks this for its last
    stage; a ``transformers`` model (not a :class:`CausalLM`, no stage of ours) gets None here.
    """
    if not isinstance(model, CausalLM):
        return None
    return _fused_ignore_index(model, loss_fn, tensor_parallel)


def _fused_ignore_index(model: nn.Module, loss_fn: object, tensor_parallel: bool) -> int | None:
    if type(loss_fn) is not CausalLMLoss:
        return None
    if not _fusing(model, next(model.parameters()).device):  # under pp, a rank without the head decides alike
        return None
    if tensor_parallel:
        _announce(
            "tp", "fused LM head + cross-entropy off under tp > 1: the logits path with loss parallel runs"
        )
        return None
    _announce("fused", "LM head + cross-entropy fused (no [tokens, vocab] logits)")
    return loss_fn.ignore_index


def fused_causal_lm_loss(
    model: nn.Module,
    inputs: ModelInputs,
    labels: torch.Tensor,
    loss_fn: object,
    *,
    tensor_parallel: bool = False,
) -> torch.Tensor | None:
    """``loss_fn(model(*inputs), labels)`` through :meth:`CausalLM.forward_loss` when that is the same loss
    (:func:`fused_loss_ignore_index`, and ``model`` holds its head); None where the caller must run the logits
    path.

    A ``transformers`` causal LM is fused alike where its head is a plain linear layer on the base model's last
    hidden states (:mod:`lightning_d9d.models.hf.loss`), under the same conditions and switches
    (``model.fuse_head_loss`` if set, ``$LIGHTNING_D9D_FUSED_LOSS``, CUDA by default, not under tp)."""
    run = _fused_loss(model, inputs, loss_fn, tensor_parallel)
    return None if run is None else run(labels)


def fuses_head_loss(
    model: nn.Module, inputs: ModelInputs, loss_fn: object, *, tensor_parallel: bool = False
) -> bool:
    """Whether :func:`fused_causal_lm_loss` computes this loss with the head fused (no ``[tokens, vocab]``
    logits), asked before it runs (the memory plan's head depends on it). The same decision, runs nothing: it
    only logs the choice once, as the loss itself would."""
    return _fused_loss(model, inputs, loss_fn, tensor_parallel) is not None


def _fused_loss(
    model: nn.Module, inputs: ModelInputs, loss_fn: object, tensor_parallel: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fused loss as a function of the labels where every condition holds (see :func:`fused_causal_lm_loss`),
    else None: one decision for the loss and for :func:`fuses_head_loss`."""
    if is_transformers_model(model):
        return _fused_transformers_loss(model, inputs, loss_fn, tensor_parallel)
    if isinstance(inputs, Mapping):  # our forward's keywords; anything else keeps the logits path
        if not {"input_ids"} <= set(inputs) <= {"input_ids", "position_ids"}:
            return None
        inputs = (
            (inputs["input_ids"], inputs["position_ids"])
            if "position_ids" in inputs
            else (inputs["input_ids"],)
        )
    if not isinstance(model, CausalLM) or model.lm_head is None or not 1 <= len(inputs) <= 2:
        return None
    ignore_index = fused_loss_ignore_index(model, loss_fn, tensor_parallel=tensor_parallel)
    if ignore_index is None:
        return None
    ids, position_ids = inputs[0], (inputs[1] if len(inputs) == 2 else None)

    def run(labels: torch.Tensor) -> torch.Tensor:
        if isinstance(model, FSDPModule) and model not in _FSDP_REGISTERED:
            # FSDP gathers the root's parameters (the head) only around registered forward methods.
            register_fsdp_forward_method(model, "forward_loss")
            _FSDP_REGISTERED.add(model)
        return model.forward_loss(ids, labels, position_ids, ignore_index=ignore_index)

    return run


def _fused_transformers_loss(
    model: nn.Module, inputs: ModelInputs, loss_fn: object, tensor_parallel: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    from lightning_d9d.models.hf import loss as hf_loss  # the adapter's package imports the plans

    if type(loss_fn) is not CausalLMLoss:
        return None
    arguments = hf_loss.decoder_inputs(model, inputs)
    if arguments is None:
        return None
    ignore_index = _fused_ignore_index(model, loss_fn, tensor_parallel)
    if ignore_index is None:
        return None

    def run(labels: torch.Tensor) -> torch.Tensor:
        return hf_loss.forward_loss(model, labels, ignore_index, arguments)

    return run


def _fusing(model: nn.Module, device: torch.device) -> bool:
    chosen = getattr(model, "fuse_head_loss", None)  # a transformers model may be given one too
    if chosen is not None:
        return bool(chosen)
    setting = os.environ.get(FUSED_LOSS_ENV)
    if setting not in (None, "", "0", "1"):
        raise ValueError(
            f"${FUSED_LOSS_ENV}={setting!r}: set 1 (fuse), 0 (logits path) or leave it unset (CUDA only)"
        )
    if setting:
        return setting == "1"
    return device.type == "cuda"


def _announce(key: str, message: str) -> None:
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        log.info(message)
