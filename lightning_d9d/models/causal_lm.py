"""What every decoder-only causal LM of ours shares, whatever its blocks: the tied LM head, the pipeline cut, and
the LM head's loss computed without logits (with and without pipeline stages), which the model declares to the
loss layer (:class:`~lightning_d9d.modules.head.FusedHead`); when it runs is the loss layer's choice
(:mod:`lightning_d9d.loss.head`).

A model keeps ``self.model`` (with ``embed_tokens``, a ``layers`` ModuleDict keyed by layer number, ``norm``),
``self.lm_head`` and ``self.config.tie_word_embeddings``; its own file holds its config, blocks and plan.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from typing_extensions import Self

from lightning_d9d.kernels.linear_cross_entropy import linear_cross_entropy
from lightning_d9d.modules.head import HeadLoss
from lightning_d9d.modules.inputs import ModelInputs

_FSDP_REGISTERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class CausalLM(nn.Module):
    """Base of the causal LMs: ties the head to the embedding and drops what a pipeline rank does not hold; a
    :class:`~lightning_d9d.modules.head.FusedHead` (:meth:`bind_head_loss`, stages that take the labels)."""

    config: Any
    model: Any  # the decoder: embed_tokens, layers (ModuleDict), norm
    lm_head: nn.Linear | None
    # Whether the strategy's ``model_loss`` with ``causal_lm_loss`` calls :meth:`forward_loss` (head and loss
    # fused, no [tokens, vocab] logits) instead of ``forward`` then the loss. None: on CUDA, where the logits'
    # memory matters (on CPU the logits path keeps results bitwise equal to a plain loop), unless
    # $LIGHTNING_D9D_FUSED_LOSS=1 / 0 says otherwise (read by :mod:`lightning_d9d.loss.head`).
    fuse_head_loss: bool | None = None
    # Our stages take labels= / ignore_index= (CausalLMStage.head): the last one then returns the loss.
    stages_take_labels = True

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
        (:func:`~lightning_d9d.kernels.linear_cross_entropy`). Under FSDP call it through :meth:`bind_head_loss`,
        which registers it as a forward method (so the head is unsharded)."""
        if self.lm_head is None:
            raise ValueError(
                f"{type(self).__name__}.forward_loss needs the LM head; this pipeline stage does not hold it"
            )
        return head_loss(self.model(input_ids, position_ids), self.lm_head, labels, ignore_index)

    def bind_head_loss(self, inputs: ModelInputs) -> HeadLoss | None:
        """:meth:`forward_loss` bound to ``inputs`` (``(ids,)``, ``(ids, position_ids)`` or a dict of those names)
        where this rank holds the head; None for other inputs, which keep the logits path (see
        :class:`~lightning_d9d.modules.head.FusedHead`)."""
        if isinstance(inputs, Mapping):  # our forward's keywords; anything else keeps the logits path
            if not {"input_ids"} <= set(inputs) <= {"input_ids", "position_ids"}:
                return None
            inputs = (
                (inputs["input_ids"], inputs["position_ids"])
                if "position_ids" in inputs
                else (inputs["input_ids"],)
            )
        if self.lm_head is None or not 1 <= len(inputs) <= 2:
            return None
        ids, position_ids = inputs[0], (inputs[1] if len(inputs) == 2 else None)

        def run(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
            if isinstance(self, FSDPModule) and self not in _FSDP_REGISTERED:
                # FSDP gathers the root's parameters (the head) only around registered forward methods.
                register_fsdp_forward_method(self, "forward_loss")
                _FSDP_REGISTERED.add(self)
            return self.forward_loss(ids, labels, position_ids, ignore_index=ignore_index)

        return run

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
        # A tied embedding and head on two ranks: each keeps its copy, which the pipeline runner trains as one
        # (lightning_d9d.pipeline.tied).
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
    ``labels`` (the loss layer does when :func:`~lightning_d9d.loss.fused_ignore_index` says so), in the head's
    loss computed without logits. The loss is then computed inside the stage's forward, where FSDP has gathered
    the head."""

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
