"""Gemma 3 text (Gemma Team 2025, "Gemma 3 Technical Report") in Flax NNX: transformers' `Gemma3ForCausalLM`.

What differs from Llama, each taken from the HF config:
- layers alternate sliding-window and global attention by ``layer_types`` (5 local : 1 global in the released
  models), local layers with their own rotary base (``rope_parameters["sliding_attention"]``, 10,000);
- queries and keys pass a per-head RMSNorm; attention scale is ``query_pre_attn_scalar ** -0.5``; the config's
  ``attn_logit_softcapping`` is ignored, as transformers' Gemma 3 ignores it (Gemma 3 replaced Gemma 2's
  attention soft-cap by the q/k norms; the released configs set it to null);
- four norms per layer (before and after attention, before and after the MLP), all ``x * (1 + w)``
  (`GemmaRMSNorm`);
- embeddings multiplied by sqrt(hidden_size) (in the parameter dtype, as transformers does); a GeGLU MLP
  (gelu-tanh); the LM head tied to the embedding; an optional ``final_logit_softcapping``.

Each is a class attribute of `Gemma3ForCausalLM` (a hook of the shared decoder stack in models/llama.py).
Parameter paths equal transformers' state-dict keys (``model.layers.0.pre_feedforward_layernorm.weight``).
"""

from __future__ import annotations

from sgl_jax.srt.layers.layernorm import GemmaRMSNorm
from sgl_jax.srt.models.llama import LlamaForCausalLM


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model over the paged KV cache: the shared decoder stack (models/llama.py) with the hooks
    above. Same call contract and Args as `LlamaForCausalLM`; ``hf_config`` is a transformers `Gemma3TextConfig`
    (or its config.json)."""

    architectures = ("Gemma3ForCausalLM",)
    qk_norm = True
    norm_cls = GemmaRMSNorm
    norm_placement = "sandwich"
    activation = "gelu_pytorch_tanh"
    activation_key = "hidden_activation"
    query_scale_key = "query_pre_attn_scalar"
    final_soft_cap_key = "final_logit_softcapping"
    scale_embeddings = True
    tied_head_default = True


EntryClass = [Gemma3ForCausalLM]
