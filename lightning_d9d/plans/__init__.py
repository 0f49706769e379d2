"""Parallel plans: plain functions that change a module in place with torch's own distributed APIs."""

from lightning_d9d.plans.blocks import convert_blocks_to_float8, parallelize_blocks
from lightning_d9d.plans.checkpointing import apply_activation_checkpointing
from lightning_d9d.plans.compile import apply_compile
from lightning_d9d.plans.context import ContextSplitAware, parallelize_context, split_batch
from lightning_d9d.plans.data_parallel import parallelize_data
from lightning_d9d.plans.default import parallelize_default, repeated_blocks
from lightning_d9d.plans.degrees import DATA_PARALLEL, IMPLEMENTED, require_degrees
from lightning_d9d.plans.expert import check_expert_split, parallelize_expert
from lightning_d9d.plans.fsdp import parallelize_fsdp
from lightning_d9d.plans.lora import LoRA, apply_lora
from lightning_d9d.plans.options import ParallelOptions
from lightning_d9d.plans.replicate import parallelize_replicate
from lightning_d9d.plans.routing import route_on_sequence_shards, sum_gradients_over_tp
from lightning_d9d.plans.tensor import (
    check_sequence_length,
    check_tensor_parallel_sizes,
    column_parallel,
    gather_sequence,
    local_loss,
    local_to_sequence_shard,
    maybe_loss_parallel,
    parallelize_tensor,
    per_head_norm,
    row_parallel_to_sequence,
    sequence_parallel_norm,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from lightning_d9d.plans.traits import Parallelizable, SeededInit

__all__ = [
    "DATA_PARALLEL",
    "IMPLEMENTED",
    "ContextSplitAware",
    "LoRA",
    "ParallelOptions",
    "Parallelizable",
    "SeededInit",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_lora",
    "check_expert_split",
    "check_sequence_length",
    "check_tensor_parallel_sizes",
    "column_parallel",
    "convert_blocks_to_float8",
    "gather_sequence",
    "local_loss",
    "local_to_sequence_shard",
    "maybe_loss_parallel",
    "parallelize_blocks",
    "parallelize_context",
    "parallelize_data",
    "parallelize_default",
    "parallelize_expert",
    "parallelize_fsdp",
    "parallelize_replicate",
    "parallelize_tensor",
    "per_head_norm",
    "repeated_blocks",
    "require_degrees",
    "route_on_sequence_shards",
    "row_parallel_to_sequence",
    "sequence_parallel_norm",
    "split_batch",
    "sum_gradients_over_tp",
    "vocab_parallel_embedding",
    "vocab_parallel_head",
]
