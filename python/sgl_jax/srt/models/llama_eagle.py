"""An EAGLE draft head (Li et al. 2024, "EAGLE" and "EAGLE-2") in its published checkpoint format: SafeAILab's
``cnets1`` model, served by SGLang as ``LlamaForCausalLMEagle`` (published configs say ``LlamaForCausalLM``, one
layer; `head_architecture` maps them).

One decoder layer over the target's last hidden states (final-norm: what the target's LM head reads). Draft row p
sits in position p's KV slot, is rotated at p, and reads ``x = fc(concat(embed(t[p+1]), h[p]))`` [T, 2H] -> [T, H]
with ``h[p]`` the target's hidden state at p (the draft extend after a target step) or the head's own output of the
row before (a draft decode step: unlike EAGLE-3, every step goes through ``fc``). Layer 0 has no input norm:
``x' = x + o_proj(attn(x))``, ``out = x' + mlp(post_attention_layernorm(x'))``, no final norm; the target's LM head
reads ``out`` directly, over the whole vocabulary (no draft-vocabulary map).

Parameter paths equal the checkpoint's keys (``fc.weight``, ``fc.bias`` when the config's ``bias`` is not false,
as SafeAILab's loader decides; ``layers.0.self_attn.q_proj.weight``, ``layers.0.post_attention_layernorm.weight``,
``layers.0.mlp.*``). The checkpoint's ``embed_tokens.weight`` is not read: the embedding and the LM head are the
target's (as SGLang's EAGLE worker sets them).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.forward_batch import ForwardBatch
from sgl_jax.srt.layers.attention import LayerKV
from sgl_jax.srt.layers.layernorm import RMSNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.embedding import Table, lookup
from sgl_jax.srt.layers.logits_processor import compute_logits
from sgl_jax.srt.models.llama import LlamaAttention, LlamaMLP


def head_architecture(head_config):
    """An EAGLE head's `ModelConfig` with the architecture this file serves: SafeAILab's published configs name
    ``LlamaForCausalLM`` with one layer; SGLang asks users to rename it ``LlamaForCausalLMEagle``, here either is
    taken.

    Raises:
        ValueError: another architecture, or more than one layer.
    """
    if head_config.architecture not in ("LlamaForCausalLM", "LlamaForCausalLMEagle") or \
            head_config.num_hidden_layers != 1:
        raise ValueError(f"--speculative-draft-model-path {head_config.model_path}: an EAGLE head is a one-layer "
                         f"LlamaForCausalLMEagle (or LlamaForCausalLM), not a {head_config.num_hidden_layers}-layer "
                         f"{head_config.architecture}")
    return dataclasses.replace(head_config, architecture="LlamaForCausalLMEagle")


class EagleDecoderLayer(nnx.Module):
    """The head's one decoder layer: attention without an input norm, then the usual post-attention norm and MLP."""

    def __init__(self, cfg, model_config, *, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        hidden = model_config.hidden_size
        self.self_attn = LlamaAttention(cfg, model_config, 0, qk_norm=False, dtype=dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = RMSNorm(hidden, eps=float(cfg.rms_norm_eps), dtype=dtype)
        self.mlp = LlamaMLP(hidden, int(cfg.intermediate_size), dtype, rngs)

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        attn_out, kv = self.self_attn(x, fb, kv)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaForCausalLMEagle(nnx.Module):
    """The EAGLE head (see the module docstring).

    Args:
        model_config: the head's `ModelConfig` (``hidden_size`` H, one layer; ``hf_config.bias``: fc's bias,
            default true as SafeAILab's loader).
        dtype, rngs, mesh: as `LlamaForCausalLM`.
    """

    architectures = ("LlamaForCausalLMEagle",)  # the registry's hooks (models/llama.LlamaForCausalLM's docstring)
    role = "causal"
    is_encoder = False
    embedding_form_of: Tuple[str, ...] = ()

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        hidden = model_config.hidden_size
        self.fc = Linear(2 * hidden, hidden, use_bias=bool(getattr(cfg, "bias", True)), dtype=dtype, rngs=rngs)
        self.layers = nnx.List([EagleDecoderLayer(cfg, model_config, dtype=dtype, rngs=rngs, mesh=mesh)])

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV], hidden_in: jax.Array, embed_weight: Table,
                 *, project: bool) -> Tuple[jax.Array, List[LayerKV]]:
        """One draft forward of T rows (see `LlamaForCausalLMEagle3.__call__`; `project` makes no difference
        here: the target's and the head's hidden states both go through ``fc``). Returns (the outputs [T, H]: the
        next draft step's hidden input and what the target's LM head reads, [the updated KV])."""
        emb = lookup(embed_weight, fb.input_ids, hidden_in.dtype)
        x = self.fc(jnp.concatenate([emb, hidden_in], axis=-1))
        out, kv = self.layers[0](x, fb, kv_caches[0])
        return out, [kv]

    def moe_routing(self):
        """None: the head routes nothing (see `LlamaForCausalLM.moe_routing`)."""
        return None

    def draft_logits(self, hidden: jax.Array, target_head: Table) -> jax.Array:
        """Outputs [N, H] -> float32 logits [N, V] from the target's LM head `target_head` [V, H] (a
        `layers.embedding.Table`; no norm)."""
        return compute_logits(hidden, target_head)


EntryClass = [LlamaForCausalLMEagle]
