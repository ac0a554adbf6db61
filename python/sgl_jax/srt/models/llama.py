"""Llama (Touvron et al. 2023; GQA, rope scaling incl. llama3, tied or separate LM head) in Flax NNX.

Module and parameter names mirror transformers' `LlamaForCausalLM`, so an HF state-dict key such as
``model.layers.0.self_attn.q_proj.weight`` is exactly the path of our parameter. Qwen3 reuses this file
with per-head q/k RMSNorm (`qk_norm`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.distributed.mesh import tp_size_of
from sgl_jax.srt.distributed.sharding import padded_kv_heads
from sgl_jax.srt.layers.attention import LayerKV, paged_attention
from sgl_jax.srt.layers.embedding import Embedding
from sgl_jax.srt.layers.layernorm import RMSNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.logits_processor import compute_logits
from sgl_jax.srt.layers.rotary_embedding import apply_rope, rope_inv_freq
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch


class LlamaMLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache. Under tensor parallelism (`mesh` with a
    ``tensor`` axis of size tp) K/V heads number `padded_kv_heads` (each replicated when the model has fewer
    than tp) and attention runs on each device's own heads."""

    def __init__(self, cfg, model_config, *, qk_norm: bool, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        hidden = model_config.hidden_size
        self.num_heads = model_config.num_attention_heads
        tp = 1 if mesh is None else tp_size_of(mesh)
        self.num_kv_heads = padded_kv_heads(model_config.num_key_value_heads, tp)
        self.mesh = mesh
        self.head_dim = model_config.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, dtype=dtype, rngs=rngs)
        eps = float(cfg.rms_norm_eps)
        self.q_norm = RMSNorm(self.head_dim, eps=eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=eps, dtype=dtype) if qk_norm else None
        # static (hashable) constant: not a parameter, never loaded, folded into the compiled program
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(self.head_dim, model_config.rope_parameters))
        self.sm_scale = self.head_dim ** -0.5

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        T = x.shape[0]
        q = self.q_proj(x).reshape(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, fb.positions, inv_freq)
        k = apply_rope(k, fb.positions, inv_freq)
        out, kv = paged_attention(q, k, v, kv, fb, sm_scale=self.sm_scale, mesh=self.mesh)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), kv


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg, model_config, *, qk_norm: bool, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(model_config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, model_config, qk_norm=qk_norm, dtype=dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = RMSNorm(model_config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = LlamaMLP(model_config.hidden_size, int(cfg.intermediate_size), dtype, rngs)

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        attn_out, kv = self.self_attn(self.input_layernorm(x), fb, kv)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg, model_config, *, qk_norm: bool, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        self.embed_tokens = Embedding(model_config.vocab_size, model_config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(cfg, model_config, qk_norm=qk_norm, dtype=dtype, rngs=rngs, mesh=mesh)
            for _ in range(model_config.num_hidden_layers)
        ])
        self.norm = RMSNorm(model_config.hidden_size, eps=float(cfg.rms_norm_eps), dtype=dtype)


class LlamaForCausalLM(nnx.Module):
    """Causal LM over the paged KV cache.

    Args:
        model_config: `ModelConfig` (sizes, rope parameters; ``hf_config`` for the rest).
        dtype: parameter / activation dtype (jnp.float32 or jnp.bfloat16).
        rngs: initializer randomness; real weights are loaded over the initial values.
        mesh: the device mesh (distributed/mesh.py); its ``tensor`` axis shards heads, MLP width and the
            vocabulary (specs in distributed/sharding.py). None: one device, no shard_map.
    """

    qk_norm = False

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.model = LlamaModel(cfg, model_config, qk_norm=self.qk_norm, dtype=dtype, rngs=rngs, mesh=mesh)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            model_config.hidden_size, model_config.vocab_size, dtype=dtype, rngs=rngs)

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
        """Run all layers.

        Args:
            fb: ForwardBatch with T tokens.
            kv_caches: one (k_pages, v_pages) per layer (donated by the caller's jit).
        Returns:
            (final-norm hidden states [T, hidden_size], updated kv_caches).
        """
        x = self.model.embed_tokens(fb.input_ids)
        new_caches = []
        for layer, kv in zip(self.model.layers, kv_caches):
            x, kv = layer(x, fb, kv)
            new_caches.append(kv)
        return self.model.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return compute_logits(hidden, head.weight[...])
