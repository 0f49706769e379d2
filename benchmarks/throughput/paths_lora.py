"""The LoRA paths' common ground (``benchmarks/lora_throughput.py`` runs them): the adapters every path trains
(``lora_config``), the baseline's model (transformers + peft, ``_peft_model``), and what makes the three start from
the same weights (the strategy's start of a transformers model, each adapter as the LoRA plan starts it) together
with the digests that check it (``start_fingerprint``)."""

from __future__ import annotations

from typing import Any

from .paths_baseline import _hf_model

# The adapters of every LoRA path: the projections of the decoder blocks (peft's target_modules, our targets).
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config() -> Any:
    """Our side's ``LoRA`` of the LoRA paths: ``LORA_RANK`` / ``LORA_ALPHA`` on ``LORA_TARGETS``, no dropout, the
    frozen base in bf16 (the adapters stay in the model's fp32)."""
    import torch

    from lightning_d9d.plans.lora import LoRA

    return LoRA(rank=LORA_RANK, alpha=LORA_ALPHA, targets=LORA_TARGETS, base_dtype=torch.bfloat16)


def _peft_model(config: Any, device: Any, seed: int) -> Any:
    """The LoRA baseline's model as a user builds it without us: transformers' causal LM of ``config``'s shape built
    in bf16 on ``device``, sdpa attention, no KV cache, then ``peft.get_peft_model`` with the same adapters as
    ``lora_config``: every other weight frozen, the adapters in fp32 (peft's default beside bf16 weights, as ours).

    It starts from the Trainer paths' weights, not from torch's RNG: the base as the strategy initialises a
    transformers model built on meta (:func:`transformers_start_` from ``seed``), each adapter as the LoRA plan
    initialises it under the name the Trainer paths give that layer (:func:`peft_adapter_start_`), so the loss
    guard compares runs that differ only in how they compute."""
    import peft
    import torch
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf_config(), attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.config.use_cache = False
    transformers_start_(model, seed)
    adapters = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    adapted = peft.get_peft_model(model, adapters)
    peft_adapter_start_(adapted, seed)
    adapted.train()
    return adapted


# The attribute CausalLMTraining holds its model under: the first part of every parameter name on the Trainer paths,
# which the LoRA plan seeds each adapter by (``model.model.layers.0.self_attn.q_proj``)
TRAINER_MODEL_ATTRIBUTE = "model"
# What peft puts before a transformers model's own names (``base_model.model.model.layers.0...``)
PEFT_PREFIX = "base_model.model."


def transformers_start_(model: Any, seed: int) -> None:
    """Overwrite transformers model ``model``'s parameters and buffers with the start the strategy gives a
    transformers model built on meta (``D9DStrategy``'s materialisation: ``init_transformers_model_`` from the
    seed all ranks agree on, ``torch.initial_seed()`` of rank 0): transformers' rules drawn in fp32 from
    ``(seed, module name)``, cast to each tensor's dtype."""
    from lightning_d9d.modules.hf_init import init_transformers_model_

    missed = init_transformers_model_(model, seed)
    if missed:
        raise RuntimeError(f"no transformers rule initialises {missed[:5]}: they would start as NaN")


def peft_adapter_start_(model: Any, seed: int) -> None:
    """Each of peft's adapters (``lora_A`` / ``lora_B``) of ``model`` as the LoRA plan starts the same layer on the
    Trainer paths: :func:`~lightning_d9d.modules.lora.init_adapter_` under the layer's name there, ``A`` drawn
    from ``(seed, <name>.lora_A.weight)``, ``B`` zero."""
    from typing import cast

    from peft.tuners.lora import LoraLayer
    from torch import nn

    from lightning_d9d.modules.lora import LoRALinear, init_adapter_

    started = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.active_adapters:
            # init_adapter_ reads the two linears of an adapter: peft keeps them in dicts by adapter name
            pair = nn.Module()
            pair.lora_A, pair.lora_B = layer.lora_A[adapter], layer.lora_B[adapter]
            init_adapter_(cast(LoRALinear, pair), trainer_param_name(name), seed)
            started += 1
    if not started:
        raise RuntimeError(f"{type(model).__name__} holds no peft LoRA layer to start")


def trainer_param_name(name: str) -> str:
    """A parameter's (or module's) name as the Trainer paths' LightningModule names it: without the wrappers compile
    and activation checkpointing add, a peft model's names as our adapted layers' (``base_model.model.X`` ->
    ``model.X``, ``q_proj.base_layer.weight`` -> ``q_proj.weight``, ``q_proj.lora_A.default.weight`` ->
    ``q_proj.lora_A.weight``)."""
    from lightning_d9d.modules.init import canonical_param_name

    name = canonical_param_name(name)
    if not name.startswith(PEFT_PREFIX):
        return name
    name = f"{TRAINER_MODEL_ATTRIBUTE}.{name.removeprefix(PEFT_PREFIX)}"
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.", f".{part}.").removesuffix(f".{part}.default")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def transformers_start_into_(model: Any, config: Any, seed: int) -> None:
    """Give our model ``model`` (LoRA applied, materialised) the frozen base transformers' model of ``config``'s
    shape starts from (:func:`transformers_start_`, the same parameter names): built on meta in the base dtype,
    initialised on the CPU, copied by name. The adapters keep the LoRA plan's start, which the paths share."""
    import torch

    from lightning_d9d.modules.init import assign_full_, canonical_param_name
    from lightning_d9d.strategies.materialize import to_empty_except_metrics

    source = _hf_model(config, "meta").to(lora_config().base_dtype)
    to_empty_except_metrics(source, torch.device("cpu"))  # keeps a tied embedding one tensor
    transformers_start_(source, seed)
    weights = dict(source.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:  # an adapter
            continue
        weight = weights.get(canonical_param_name(name))
        if weight is None or weight.shape != param.shape or weight.dtype != param.dtype:
            found = None if weight is None else (tuple(weight.shape), weight.dtype)
            raise RuntimeError(
                f"{name} {tuple(param.shape)} {param.dtype}: transformers' model holds {found} under that name"
            )
        assign_full_(param, weight)


def start_fingerprint(named: Any) -> dict[str, str]:
    """Digests of a model's parameters, named as the Trainer paths name them (:func:`trainer_param_name`):
    ``base`` (the frozen weights) and ``adapters`` (``lora_A`` / ``lora_B``). Equal digests: the same names, dtypes,
    shapes and bits. Each tensor is summed on its own device (:func:`_bits_checksum`): seconds for 8B weights."""
    import hashlib

    digests = {part: hashlib.blake2b(digest_size=8) for part in ("base", "adapters")}
    for name, tensor in sorted(((trainer_param_name(n), p) for n, p in named), key=lambda item: item[0]):
        part = "adapters" if ".lora_A." in name or ".lora_B." in name else "base"
        line = f"{name} {tensor.dtype} {tuple(tensor.shape)} {_bits_checksum(tensor)}\n"
        digests[part].update(line.encode())
    return {part: digest.hexdigest() for part, digest in digests.items()}


# a Mersenne prime: each element's term (its bits x a weight of its position, modulo this) stays below 2^31, so a
# chunk's int64 sum is exact
_CHECKSUM_MODULUS, _CHECKSUM_CHUNK = 2**31 - 1, 2**24


def _bits_checksum(tensor: Any) -> int:
    """A position-weighted sum of ``tensor``'s bits (a ``DTensor``'s whole value), exact in int64 arithmetic."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = 0
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        chunk = bits[start : start + _CHECKSUM_CHUNK].to(torch.int64) % _CHECKSUM_MODULUS
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65_521 + 1
        total += int((chunk * weights % _CHECKSUM_MODULUS).sum())
    return total % _CHECKSUM_MODULUS
