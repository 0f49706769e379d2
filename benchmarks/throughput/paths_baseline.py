"""The transformers paths (``hf_*``): transformers' causal LM as a user builds it, on the plain loops
(eager, whole-model compile, or per-layer compile under FSDP2 as torchtitan-style training runs it) and under the
Trainer (``CausalLMTraining``, the LightningModule a user writes around it; the LoRA paths train it too)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def hf_plain_loop_model(path: str, config: Any, device: Any) -> tuple[Any, Any]:
    """A transformers plain-loop path's model and its callable ``inputs -> logits``: ``hf_eager``, ``hf_compiled``
    (``torch.compile`` of the whole model), ``hf_fsdp_compiled`` (:func:`_hf_fsdp_compiled`)."""
    import torch

    model = _hf_model(config, device)
    if path == "hf_fsdp_compiled":
        return model, _hf_fsdp_compiled(model, device)
    runner = torch.compile(model) if path == "hf_compiled" else model

    def forward(inputs: Any) -> Any:
        return runner(input_ids=inputs, use_cache=False).logits

    return model, forward


def _hf_model(config: Any, device: Any) -> Any:
    """transformers' causal LM of ``config``'s shape (``Qwen3ForCausalLM``, or ``Qwen3MoeForCausalLM`` for the MoE
    shape): sdpa attention, fp32 parameters, no KV cache, the head tied where the config ties it; on ``device``
    (``meta`` for the Trainer paths: the strategy materialises it and initialises it by transformers' rules)."""
    import torch
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf_config(), attn_implementation="sdpa"
        )
    model = model.to(device=device, dtype=torch.float32)
    model.config.use_cache = False
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        raise RuntimeError(f"HF model uses attn_implementation={attn!r}, expected 'sdpa'")
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("HF model did not tie lm_head to embed_tokens")
    model.train()
    return model


def _hf_fsdp_compiled(model: Any, device: Any, layers: Any = None) -> Any:
    """transformers' model as torchtitan-style training would run it on one rank: ``torch.compile`` per decoder
    layer, then FSDP2 per layer and the root with bf16 parameters and fp32 gradient reduction. ``layers``: the
    decoder layers where they are not ``model.model.layers`` (a ``PeftModel``'s)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers if layers is None else layers:
        layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    def forward(inputs: Any) -> Any:
        return model(input_ids=inputs, use_cache=False).logits

    return forward


class LogitsLoss:
    """``causal_lm_loss`` on a transformers output's ``.logits``, counting the same tokens (a ``CountedLoss``).

    ``hf_trainer*`` pass ``causal_lm_loss`` itself to ``model_loss`` where that takes a transformers output (the
    strategy then computes the fused LM head + cross-entropy from the hidden states, as for our models: issue
    24); until it does (``causal_lm_loss`` reads ``.shape`` of its first argument: AttributeError on a
    ``CausalLMOutputWithPast``), this wrapper runs instead, on the logits.
    """

    def __call__(self, output: Any, labels: Any) -> Any:
        from lightning_d9d.modules.loss import causal_lm_loss

        return causal_lm_loss(output.logits, labels)

    def count(self, labels: Any) -> Any:
        from lightning_d9d.modules.loss import causal_lm_loss

        return causal_lm_loss.count(labels)

    def __repr__(self) -> str:
        return "LogitsLoss(causal_lm_loss on output.logits)"


def causal_lm_training(
    build: Any,
    *,
    lean: bool,
    master_weights: bool,
    args: argparse.Namespace,
    device: Any,
    start: Callable[[Any], None] | None = None,
) -> Any:
    """The Trainer paths' :class:`CausalLMTraining` around the model ``build`` returns (``hf_trainer*``:
    transformers' model on meta; the LoRA path of ours: our model on meta), its AdamW at ``args.lr``, fused on a
    CUDA ``device``. Lightning is imported here, in the worker that trains, not where the paths are listed."""
    import lightning as L
    import torch

    import lightning_d9d
    from lightning_d9d.modules.loss import causal_lm_loss

    class CausalLMTraining(L.LightningModule):
        """A causal LM in a LightningModule as a user writes one: built on ``meta`` by ``build`` in
        ``configure_model`` (transformers' model: the strategy shards it with the transformers adapter's plan, then
        initialises it by transformers' ``_init_weights`` rules; ours: by its own plan and ``init_weights``), the
        loss through ``lightning_d9d.model_loss`` with ``causal_lm_loss``, the plain loops' fused AdamW over the
        parameters that train (with LoRA: the adapters) at a constant learning rate, the loss logged without
        ``prog_bar``. ``lean`` (``hf_trainer_compiled_lean``): the loss on ``output.logits`` outside
        ``model_loss``, as ``LeanPretraining`` (``paths_ours``) scores ours. ``start``: what the model is given once the
        strategy has initialised it, before the first step (the LoRA path of our model: the weights the other
        LoRA paths start from)."""

        def __init__(
            self, build: Any, lean: bool, master_weights: bool, start: Callable[[Any], None] | None = None
        ) -> None:
            super().__init__()
            self.build = build
            self.lean = lean
            self.master_weights = master_weights
            self.start = start
            self.model: Any = None
            # causal_lm_loss, or LogitsLoss until causal_lm_loss takes a transformers output: tried at step 0
            self.loss_fn: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = self.build()

        def on_fit_start(self) -> None:  # after the strategy's setup: the model is materialised
            if self.start is not None:
                self.start(self.model)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            ids, target = batch["input_ids"], batch["labels"]
            loss = None
            if self.lean:
                loss = causal_lm_loss(self.model(input_ids=ids).logits, target)
            elif self.loss_fn is None:  # step 0: does causal_lm_loss take the transformers output yet?
                try:  # (then the strategy computes the fused LM head + loss from the hidden states)
                    loss = lightning_d9d.model_loss(self, self.model, (ids,), target, causal_lm_loss)
                    self.loss_fn = causal_lm_loss
                except AttributeError as error:  # not yet: it wants logits (LogitsLoss's docstring)
                    print(f"causal_lm_loss refused the transformers output ({error}): LogitsLoss", flush=True)
                    self.loss_fn = LogitsLoss()
            if loss is None:  # (a retry runs here, outside the except block: the failed graph is freed)
                loss = lightning_d9d.model_loss(self, self.model, (ids,), target, self.loss_fn)
            self.log("train/loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            hyper: dict[str, Any] = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
            trainable = [p for p in self.parameters() if p.requires_grad]
            if self.master_weights:
                from lightning_d9d.optim import MasterWeightAdamW

                return MasterWeightAdamW(trainable, **hyper)
            fused: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
            return torch.optim.AdamW(trainable, **hyper, **fused)

    return CausalLMTraining(build, lean=lean, master_weights=master_weights, start=start)
