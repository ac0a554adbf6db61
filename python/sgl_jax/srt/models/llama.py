"""Llama (Touvron et al. 2023; GQA, rope scaling incl. llama3, tied or separate LM head) in Flax NNX.

Module and parameter names mirror transformers' `LlamaForCausalLM`, so an HF state-dict key such as
``model.layers.0.self_attn.q_proj.weight`` is exactly the path of our parameter. Qwen3 reuses this file
with per-head q/k RMSNorm (`qk_norm`) and, when its config enables them, sliding-window layers; Gemma 3
reuses its attention and MLP.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.distributed.mesh import tp_size_of
from sgl_jax.srt.distributed.sharding import padded_kv_heads
from sgl_jax.srt.layers.activation import ACTIVATIONS
from sgl_jax.srt.layers.attention import LayerKV, paged_attention
from sgl_jax.srt.layers.embedding import Embedding, table_of
from sgl_jax.srt.layers.layernorm import RMSNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.logits_processor import compute_logits
from sgl_jax.srt.layers.rotary_embedding import apply_rope, rope_inv_freq
from sgl_jax.srt.forward_batch import ForwardBatch


def lora_none(module: str) -> None:
    """No LoRA slots for any module (`ModelConfig.lora_slots_of` when LoRA is off)."""
    return None


def lora_slots_of(model_config):
    """module name -> the (slots, rank, backend) of its LoRA slots or None (`ModelConfig.lora_slots_of`)."""
    return getattr(model_config, "lora_slots_of", lora_none)


class LlamaMLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act a layers/activation.ACTIVATIONS name (silu: SwiGLU;
    gelu_pytorch_tanh: Gemma's GeGLU). `quantization`:
    the projections' ``--quantization`` method or QuantScheme (None: not quantized). `lora`: module name ->
    its LoRA slots (`Linear`'s ``lora``) or None.

    Raises:
        NotImplementedError: an activation outside ACTIVATIONS.
    """

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, activation: str = "silu",
                 quantization=None, lora=lora_none):
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        kw = dict(dtype=dtype, rngs=rngs, quantization=quantization)
        self.gate_proj = Linear(hidden, intermediate, lora=lora("gate_proj"), **kw)
        self.up_proj = Linear(hidden, intermediate, lora=lora("up_proj"), **kw)
        self.down_proj = Linear(intermediate, hidden, lora=lora("down_proj"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array, lora_ids: Optional[jax.Array] = None) -> jax.Array:
        """x [T, hidden] -> [T, hidden]; `lora_ids` int32[T]: each token's LoRA slot (layers/lora.py), or None."""
        h = ACTIVATIONS[self.activation](self.gate_proj(x, lora_ids)) * self.up_proj(x, lora_ids)
        return self.down_proj(h, lora_ids)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache. Under tensor parallelism (`mesh` with a
    ``tensor`` axis of size tp) K/V heads number `padded_kv_heads` (each replicated when the model has fewer
    than tp) and attention runs on each device's own heads.

    Layer `layer_id` is a sliding-window layer when the model config says so (`ModelConfig.layer_window`):
    its queries see only the last ``sliding_window`` positions, and its rotary base may differ
    (`ModelConfig.layer_rope_parameters`). `norm_cls` is the q/k norm (Gemma's is ``x * (1 + w)``),
    `sm_scale` overrides ``head_dim ** -0.5`` (Gemma's ``query_pre_attn_scalar ** -0.5``), `soft_cap` caps the
    attention scores (Gemma 2), `in_features` the q/k/v projections' input width (default hidden_size).
    """

    def __init__(self, cfg, model_config, layer_id: int, *, qk_norm: bool, dtype, rngs: nnx.Rngs,
                 mesh: Optional[Mesh] = None, norm_cls=RMSNorm, sm_scale: Optional[float] = None,
                 soft_cap: Optional[float] = None, in_features: Optional[int] = None):
        hidden = model_config.hidden_size
        q_in = in_features or hidden  # q/k/v input width (an EAGLE-3 draft layer's is 2 x hidden)
        self.num_heads = model_config.num_attention_heads
        tp = 1 if mesh is None else tp_size_of(mesh)
        self.num_kv_heads = padded_kv_heads(model_config.num_key_value_heads, tp)
        self.mesh = mesh
        self.head_dim = model_config.head_dim
        # q/k/v biases: attention_bias (Llama, Qwen3, Gemma 3: o_proj's too), Qwen2-MoE's qkv_bias, always in dense
        # Qwen2 (model type "qwen2", no config flag; o_proj none)
        o_bias = bool(getattr(cfg, "attention_bias", False))
        bias = bool(o_bias or getattr(cfg, "qkv_bias", False) or getattr(cfg, "model_type", None) == "qwen2")
        kw = dict(dtype=dtype, rngs=rngs, quantization=getattr(model_config, "quant_scheme", None))
        lora = lora_slots_of(model_config) if in_features is None else lora_none  # (not in EAGLE-3 draft layers)
        self.q_proj = Linear(q_in, self.num_heads * self.head_dim, use_bias=bias, lora=lora("q_proj"), **kw)
        self.k_proj = Linear(q_in, self.num_kv_heads * self.head_dim, use_bias=bias, lora=lora("k_proj"), **kw)
        self.v_proj = Linear(q_in, self.num_kv_heads * self.head_dim, use_bias=bias, lora=lora("v_proj"), **kw)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, use_bias=o_bias, lora=lora("o_proj"), **kw)
        eps = float(cfg.rms_norm_eps)
        self.q_norm = norm_cls(self.head_dim, eps=eps, dtype=dtype) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, eps=eps, dtype=dtype) if qk_norm else None
        # static (hashable) constants: not parameters, never loaded, folded into the compiled program
        rope = model_config.layer_rope_parameters(layer_id)
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(self.head_dim, rope))
        self.sm_scale = float(sm_scale) if sm_scale is not None else self.head_dim ** -0.5
        self.soft_cap = None if soft_cap is None else float(soft_cap)
        self.sliding_window = model_config.layer_window(layer_id)
        if getattr(model_config, "kv_cache_scales", False):  # an fp8 KV cache: per-KV-head scales (1 by default)
            self.k_scale = nnx.Param(jnp.ones((self.num_kv_heads,), jnp.float32))
            self.v_scale = nnx.Param(jnp.ones((self.num_kv_heads,), jnp.float32))
        else:
            self.k_scale = self.v_scale = None

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        T, ids = x.shape[0], fb.lora_ids
        q = self.q_proj(x, ids).reshape(T, self.num_heads, self.head_dim)
        k = self.k_proj(x, ids).reshape(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, ids).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, fb.positions, inv_freq)
        k = apply_rope(k, fb.positions, inv_freq)
        scales = None if self.k_scale is None else (self.k_scale[...], self.v_scale[...])
        out, kv = paged_attention(q, k, v, kv, fb, sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                                  soft_cap=self.soft_cap, mesh=self.mesh, kv_scales=scales)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim), ids), kv


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg, model_config, layer_id: int, *, qk_norm: bool, dtype, rngs: nnx.Rngs,
                 mesh: Optional[Mesh] = None):
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(model_config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, model_config, layer_id, qk_norm=qk_norm, dtype=dtype, rngs=rngs,
                                        mesh=mesh)
        self.post_attention_layernorm = RMSNorm(model_config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = LlamaMLP(model_config.hidden_size, int(cfg.intermediate_size), dtype, rngs,
                            quantization=getattr(model_config, "quant_scheme", None),
                            lora=lora_slots_of(model_config))

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        attn_out, kv = self.self_attn(self.input_layernorm(x), fb, kv)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x), fb.lora_ids), kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg, model_config, *, qk_norm: bool, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        self.embed_tokens = Embedding(model_config.vocab_size, model_config.hidden_size, dtype=dtype, rngs=rngs,
                                      quantization=getattr(model_config, "table_quant_scheme", None))
        self.layers = nnx.List([
            LlamaDecoderLayer(cfg, model_config, i, qk_norm=qk_norm, dtype=dtype, rngs=rngs, mesh=mesh)
            for i in range(model_config.num_hidden_layers)
        ])
        self.norm = RMSNorm(model_config.hidden_size, eps=float(cfg.rms_norm_eps), dtype=dtype)


def run_layers(model, x: jax.Array, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
    """Every decoder layer of `model` (``.layers``, ``.norm``) over embeddings x [T, hidden_size]; returns the
    final-norm hidden states [T, hidden_size] and the updated per-layer KV caches.

    When ``model.capture_layers`` (a sorted tuple of layer ids, set by the model runner for EAGLE-3) is not empty,
    the residual stream after each of those layers (before the final norm) is concatenated in layer order into
    [T, len(ids) * hidden_size] and sown as the ``aux_hidden_states`` intermediate (`sown_aux_hidden_states`):
    SGLang's ``layers_to_capture``, where id l means the output of layer l."""
    capture = getattr(model, "capture_layers", ())
    aux, new_caches = [], []
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches)):
        x, kv = layer(x, fb, kv)
        new_caches.append(kv)
        if i in capture:
            aux.append(x)
    if aux:
        model.sow(nnx.Intermediate, "aux_hidden_states", jnp.concatenate(aux, axis=-1),
                  reduce_fn=lambda _, new: new, init_fn=lambda: None)
    return model.norm(x), new_caches


def sown_aux_hidden_states(model) -> jax.Array:
    """The aux hidden states [T, len(ids) * hidden_size] that `run_layers` captured from `model` (the decoder stack,
    ``capture_layers`` set) in a call of the same trace.

    Raises:
        ValueError: nothing was captured (no ``capture_layers``, or the stack has not run).
    """
    sown = getattr(model, "aux_hidden_states", None)
    if sown is None:
        raise ValueError("the decoder stack captured no aux hidden states (capture_layers unset or not run)")
    return sown.get_value()


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
    has_lm_head = True  # False: a checkpoint of the decoder stack alone (an embedding model), the table as head

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.model = self.build_model(cfg, model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.tie_word_embeddings = not self.has_lm_head or bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            model_config.hidden_size, model_config.vocab_size, dtype=dtype, rngs=rngs,
            quantization=getattr(model_config, "table_quant_scheme", None))

    def build_model(self, cfg, model_config, *, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh]) -> nnx.Module:
        """The decoder stack (embeddings, ``layers``, final ``norm``); subclasses with other layers override it."""
        return LlamaModel(cfg, model_config, qk_norm=self.qk_norm, dtype=dtype, rngs=rngs, mesh=mesh)

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
        """Run all layers.

        Args:
            fb: ForwardBatch with T tokens.
            kv_caches: one (k_pages, v_pages) per layer (donated by the caller's jit).
        Returns:
            (final-norm hidden states [T, hidden_size], updated kv_caches).
        """
        return run_layers(self.model, self.model.embed_tokens(fb.input_ids), fb, kv_caches)

    def moe_routing(self):
        """(num_experts, experts per token, sparse layer indices) of a mixture-of-experts model (models/moe.py);
        None: a dense model (this one)."""
        return None

    def routed_experts(self):
        """The expert ids [L, T, k] of the last forward (models/moe.py); None: a dense model routes nothing."""
        return None

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return compute_logits(hidden, table_of(head))


class LlamaDecoderModel(LlamaForCausalLM):
    """transformers' `LlamaModel` checkpoint (the decoder stack without an LM head, tensors named without the
    ``model.`` prefix, as sentence-transformers saves decoder embedding models): served as an embedding model
    (--is-embedding), its final hidden states pooled; the embedding table stands in for the missing head."""

    has_lm_head = False


class LlamaForSequenceClassification(LlamaForCausalLM):
    """transformers' `LlamaForSequenceClassification` (``model.`` + ``score``, no LM head): a decoder reranker or
    classifier; `classify` maps the last token's final hidden state to ``num_labels`` logits (sentence-transformers'
    CrossEncoder then applies a sigmoid when there is one label)."""

    has_lm_head = False

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        super().__init__(model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.num_labels = int(model_config.hf_config.num_labels)
        self.score = Linear(model_config.hidden_size, self.num_labels, dtype=dtype, rngs=rngs)

    def classify(self, last: jax.Array) -> jax.Array:
        """last [N, hidden] (each sequence's last token's final hidden state) -> float32 logits [N, labels]."""
        return self.score(last).astype(jnp.float32)
