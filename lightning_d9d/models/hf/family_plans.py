"""The parallel plans the adapter writes for ``transformers`` families whose config ships none.

Most decoder configs ship their tensor- and pipeline-parallel plans (``base_model_tp_plan``,
``base_model_pp_plan``) and their causal LM classes the head's (``_tp_plan``, ``_pp_plan``). A family that ships
none gets its plans here, by the config's ``model_type``, in the same form, each written against that family's
forward and proven at tp=2 and pp=2 against one process (``tests/models/hf/test_hf_tensor_parallel.py``,
``tests/models/hf/test_hf_pipeline.py``). A plan the config ships always wins.

One entry per family rather than a rule for every Llama-like module layout: the layout alone does not say what the
forward does with it. A family may view its heads by a count the split must localize, fuse projections, norm all
heads' features together or hold one norm per head; a rule would apply to families nobody read. Reading each
forward once and proving the entry is what makes a family's tp exact.

- **StableLM** (``stablelm``): q/k/v viewed by ``self.num_heads`` / ``self.num_key_value_heads`` (attributes the
  adapter sets to this rank's counts), rotary on each head's first dims, ``o_proj`` over all heads; a SwiGLU MLP of
  ``gate_proj`` / ``up_proj`` / ``down_proj``; LayerNorms with biases over the hidden size between them (sequence
  parallel). With ``qk_layernorm=True`` its attention holds one LayerNorm per head (``q_layernorm.norms.<head>``),
  which this plan does not split: tp refuses it by name. The pipeline cut is the common one: ``embed_tokens``,
  ``layers``, ``norm``, then ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

PipelinePart = tuple[list[str], list[str]]  # a part's input names and output names


class FamilyPlans(NamedTuple):
    """A family's plans as ``transformers`` ships them: the base model's tp and pp plans (as in its config) and
    the head's (as in its causal LM class)."""

    tp: Mapping[str, str]
    head_tp: Mapping[str, str]
    pp: Mapping[str, PipelinePart]
    head_pp: Mapping[str, PipelinePart]


# the cut of every decoder that holds embed_tokens, layers and norm, and its head
DECODER_PP: Mapping[str, PipelinePart] = {
    "embed_tokens": (["input_ids"], ["inputs_embeds"]),
    "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "norm": (["hidden_states"], ["hidden_states"]),
}
HEAD_PP: Mapping[str, PipelinePart] = {"lm_head": (["hidden_states"], ["logits"])}
HEAD_TP: Mapping[str, str] = {"lm_head": "colwise_gather_output"}

FAMILY_PLANS: Mapping[str, FamilyPlans] = {
    "stablelm": FamilyPlans(
        tp={
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
        head_tp=HEAD_TP,
        pp=DECODER_PP,
        head_pp=HEAD_PP,
    ),
}


def family_plans(config: Any) -> FamilyPlans | None:
    """The adapter's plans for ``config``'s family (its ``model_type``), if it writes any."""
    return FAMILY_PLANS.get(str(getattr(config, "model_type", "")))
