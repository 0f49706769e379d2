"""The adapter for ``transformers`` models: plans read from the model's own config (tensor + sequence + loss
parallelism from ``base_model_tp_plan`` and the head's ``_tp_plan``, pipeline stages from ``base_model_pp_plan``,
context parallelism through the attention interface, then FSDP per decoder layer).

Nothing here imports ``transformers``: a model is recognised only if the user's code imported it already.
"""

from lightning_d9d.models.hf.config_plans import config_tp_plan, expand_plan
from lightning_d9d.models.hf.pipeline import TransformersPipeline, TransformersStage, hf_pipeline_for
from lightning_d9d.models.hf.plan import check_hf_model, hf_plan_for, is_transformers_model, parallelize_hf
from lightning_d9d.models.hf.routing import add_selection_bias, count_router_load, hf_routers
from lightning_d9d.models.hf.tensor import hf_tensor_plan

__all__ = [
    "TransformersPipeline",
    "TransformersStage",
    "add_selection_bias",
    "check_hf_model",
    "config_tp_plan",
    "count_router_load",
    "expand_plan",
    "hf_pipeline_for",
    "hf_plan_for",
    "hf_routers",
    "hf_tensor_plan",
    "is_transformers_model",
    "parallelize_hf",
]
