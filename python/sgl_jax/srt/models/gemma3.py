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

Parameter paths equal transformers' state-dict keys (``model.layers.0.pre_feedforward_layernorm.weight``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.layers.attention import LayerKV
from sgl_jax.srt.layers.embedding import Embedding, table_of
from sgl_jax.srt.layers.layernorm import GemmaRMSNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.logits_processor import compute_logits
from sgl_jax.srt.forward_batch import ForwardBatch
from sgl_jax.srt.models.llama import LlamaAttention, LlamaMLP, lora_slots_of, run_layers


def _optional_float(cfg, name: str) -> Optional[float]:
    value = getattr(cfg, name, None)
    return None if value is None else float(value)


class Gemma3DecoderLayer(nnx.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, cfg, model_config, layer_id: int, *, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        hidden, eps = model_config.hidden_size, float(cfg.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(
            cfg, model_config, layer_id, qk_norm=True, dtype=dtype, rngs=rngs, mesh=mesh, norm_cls=GemmaRMSNorm,
            sm_scale=float(cfg.query_pre_attn_scalar) ** -0.5)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = LlamaMLP(hidden, int(cfg.intermediate_size), dtype, rngs,
                            activation=getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh",
                            quantization=model_config.quant_scheme, lora=lora_slots_of(model_config))
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps, dtype=dtype)

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        attn_out, kv = self.self_attn(self.input_layernorm(x), fb, kv)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), fb.lora_ids)), kv


class Gemma3Model(nnx.Module):
    def __init__(self, cfg, model_config, *, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        self.embed_tokens = Embedding(model_config.vocab_size, model_config.hidden_size, dtype=dtype, rngs=rngs,
                                      quantization=getattr(model_config, "table_quant_scheme", None))
        self.layers = nnx.List([
            Gemma3DecoderLayer(cfg, model_config, i, dtype=dtype, rngs=rngs, mesh=mesh)
            for i in range(model_config.num_hidden_layers)
        ])
        self.norm = GemmaRMSNorm(model_config.hidden_size, eps=float(cfg.rms_norm_eps), dtype=dtype)


class Gemma3ForCausalLM(nnx.Module):
    """Gemma 3 text model over the paged KV cache (same call contract as `LlamaForCausalLM`).

    Args:
        model_config: `ModelConfig`; ``hf_config`` is a transformers `Gemma3TextConfig` (or its config.json).
        dtype: parameter / activation dtype (jnp.float32 or jnp.bfloat16).
        rngs: initializer randomness; real weights are loaded over the initial values.
        mesh: the device mesh (tensor axis shards heads, MLP width and vocabulary), or None.
    """

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.model = Gemma3Model(cfg, model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            model_config.hidden_size, model_config.vocab_size, dtype=dtype, rngs=rngs,
            quantization=getattr(model_config, "table_quant_scheme", None))
        self.embed_scale = float(model_config.hidden_size) ** 0.5
        self.final_logit_softcapping = _optional_float(cfg, "final_logit_softcapping")

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
        """fb: ForwardBatch with T tokens; kv_caches: one (k_pages, v_pages) per layer.

        Returns:
            (final-norm hidden states [T, hidden_size], updated kv_caches).
        """
        embed = self.model.embed_tokens
        return run_layers(self.model, embed(fb.input_ids) * jnp.asarray(self.embed_scale, embed.dtype), fb,
                          kv_caches)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (soft-capped when the config says so)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return compute_logits(hidden, table_of(head), soft_cap=self.final_logit_softcapping)
