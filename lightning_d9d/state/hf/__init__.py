"""Hugging Face formats of the shipped models: mappings between HF files and our modules, config checks, and
``load_hf`` / ``save_hf`` (streamed, any mesh).

A format is registered per ``model_type`` (``register_hf_format``); ``hf_format(config)`` finds it from a
``config.json`` dict. Importing this package registers the shipped ones (``qwen3``, ``qwen3_moe``).
"""

from .io import hf_side_files, load_hf, module_hf_config, reading_mapper, save_hf, writing_mapper
from .qwen3 import QWEN3, qwen3_from_hf, qwen3_hf_shapes, qwen3_signature, qwen3_to_hf
from .qwen3_moe import QWEN3_MOE, qwen3_moe_from_hf, qwen3_moe_hf_shapes, qwen3_moe_signature, qwen3_moe_to_hf
from .registry import (
    CONFIG_NAME,
    HasHFConfig,
    HFConfig,
    HFFormat,
    check_same_model,
    dtype_name,
    hf_config_json,
    hf_dict,
    hf_format,
    hf_formats,
    read_hf_config,
    register_hf_format,
)
from .transformers import declared_class, transformers_model_format
from .untrusted import check_expert_count, check_layer_count, code_fields, without_code_fields

__all__ = [
    "CONFIG_NAME",
    "QWEN3",
    "QWEN3_MOE",
    "HFConfig",
    "HFFormat",
    "HasHFConfig",
    "check_expert_count",
    "check_layer_count",
    "check_same_model",
    "code_fields",
    "declared_class",
    "dtype_name",
    "hf_config_json",
    "hf_dict",
    "hf_format",
    "hf_formats",
    "hf_side_files",
    "load_hf",
    "module_hf_config",
    "qwen3_from_hf",
    "qwen3_hf_shapes",
    "qwen3_moe_from_hf",
    "qwen3_moe_hf_shapes",
    "qwen3_moe_signature",
    "qwen3_moe_to_hf",
    "qwen3_signature",
    "qwen3_to_hf",
    "read_hf_config",
    "reading_mapper",
    "register_hf_format",
    "save_hf",
    "transformers_model_format",
    "without_code_fields",
    "writing_mapper",
]
