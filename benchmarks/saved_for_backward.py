"""What our decoder blocks keep for backward under bf16 autocast, by kind (CPU, seconds).

    PYTHONPATH=. python benchmarks/saved_for_backward.py [--compile] [--hidden 256 --layers 2 --tokens 300]
    PYTHONPATH=. python benchmarks/saved_for_backward.py --model moe [--compile]   # our Qwen3-MoE's layers

Without FSDP on the one rank (``D9DStrategy(fsdp_on_one_rank=False)``) the blocks run under autocast with fp32
parameters. Every tensor that autograd saves for backward during one forward of the decoder layers is recorded
(``torch.autograd.graph.saved_tensors_hooks``; a compiled block saves through its autograd function, so its
choices show too) and sorted into: the parameters themselves (no new memory), bf16 tensors of a parameter's
shape that are not the parameter (its autocast copy, kept from forward to backward), and activations. The token
count is chosen so no activation has a weight's shape. The answer explains part of a memory gap: FSDP's mixed
precision frees each block's bf16 parameters after its forward and casts them again in backward, so it does not
keep these copies; autocast keeps one per weight (2 bytes per parameter: about 7 GB at Qwen3-4B's 3.6B decoder
parameters). The measurement is of what autograd keeps, not of a GPU's allocator. ``--model moe`` measures our
Qwen3-MoE's layers (every layer sparse: 16 experts of width ``hidden / 4``, top-4): what the experts and the token
permutation keep, e.g. a snapshot of another commit against this tree (``PYTHONPATH=<snapshot>``).
``--master-weights``: the parameters bf16, as ``MasterWeightAdamW`` makes them (no autocast copies; the residual
stream bf16 from the embedding on).
"""

from __future__ import annotations

import argparse
import collections

import torch

from lightning_d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.optim import MasterWeightAdamW
from lightning_d9d.plans.compile import apply_compile


def saved_bytes_by_kind(model: Qwen3ForCausalLM | Qwen3MoeForCausalLM, ids: torch.Tensor) -> dict[str, int]:
    """Bytes autograd saves during the decoder layers' forward under CPU bf16 autocast, by kind."""
    layer_params = {param.data_ptr() for param in model.model.layers.parameters()}
    weight_shapes = _weight_shapes(model)
    totals: collections.Counter[str] = collections.Counter()
    recording = False

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if recording:
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.data_ptr() in layer_params:
                totals["parameters (no new memory)"] += nbytes
            elif tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weight_shapes:
                totals["bf16 copies of weights"] += nbytes
            else:
                totals["activations"] += nbytes
        return tensor

    def start(*_: object) -> None:
        nonlocal recording
        recording = True

    def stop(*_: object) -> None:
        nonlocal recording
        recording = False

    # only the decoder layers: the embedding and the head are the same with or without FSDP
    blocks = list(model.model.layers.values())
    handles = [blocks[0].register_forward_pre_hook(start), blocks[-1].register_forward_hook(stop)]
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        logits = model(ids)
    logits.float().mean().backward()
    for handle in handles:
        handle.remove()
    return dict(totals)


def _weight_shapes(model: Qwen3ForCausalLM | Qwen3MoeForCausalLM) -> set[tuple[int, ...]]:
    """The shapes a copy of a layer weight has: each matrix's (the experts' gate and up are one already)."""
    return {tuple(param.shape) for param in model.model.layers.parameters() if param.ndim >= 2}


def build(kind: str, hidden: int, layers: int) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    heads = hidden // 64
    shape = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        num_hidden_layers=layers,
    )
    if kind == "moe":
        moe = Qwen3MoeConfig.tiny(
            **shape,
            intermediate_size=3 * hidden,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=hidden // 4,
            mlp_only_layers=[],
        )
        return Qwen3MoeForCausalLM(moe)
    return Qwen3ForCausalLM(Qwen3Config.tiny(**shape, intermediate_size=3 * hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--compile", action="store_true", help="per-block torch.compile, as D9DStrategy")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=300, help="batch 3 x tokens / 3")
    parser.add_argument(
        "--master-weights", action="store_true", help="bf16 parameters, fp32 masters in MasterWeightAdamW"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build(args.model, args.hidden, args.layers)
    if args.master_weights:
        MasterWeightAdamW(model.parameters())  # the parameters become bf16, as when a run builds it
    weight_dims = {size for shape in _weight_shapes(model) for size in shape}
    if args.tokens % 3 or args.tokens in weight_dims:
        # a flattened (tokens, width) activation of a weight's shape would be counted as a weight's copy
        parser.error(
            f"--tokens {args.tokens}: choose a multiple of 3 that is no weight dimension ({weight_dims})"
        )
    if args.compile:
        apply_compile(model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (3, args.tokens // 3))
    saved_bytes_by_kind(model, ids)  # the first call compiles
    totals = saved_bytes_by_kind(model, ids)
    weights_bf16 = 2 * sum(param.numel() for param in model.model.layers.parameters() if param.ndim >= 2)
    print(
        f"{'compiled' if args.compile else 'eager'} {args.model} blocks, {args.layers} layers of hidden {args.hidden}"
        f"{', master weights' if args.master_weights else ''}:"
    )
    for kind, nbytes in sorted(totals.items()):
        print(f"  {kind:30s} {nbytes / 2**20:8.2f} MiB")
    print(f"  (a bf16 copy of the layers' weight matrices: {weights_bf16 / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
