"""Llama (Touvron et al. 2023; GQA, rope scaling incl. llama3, tied or separate LM head) in Flax NNX.

Module and parameter names mirror transformers' `LlamaForCausalLM`, so an HF state-dict key such as
``model.layers.0.self_attn.q_proj.weight`` is exactly the path of our parameter.

This is the shared decoder stack: `LlamaForCausalLM`'s class attributes are its hooks. A model file subclasses it
and states what differs as class attributes: the HF ``architectures`` names it serves, its role, and its quirks
(q/k/v biases, q/k norm, the norm kind and placement, the MLP activation, the attention scale and soft-caps,
scaled embeddings, a tied head by default, the MLP of each layer). Sliding-window layers (the window pattern)
come from the config (`ModelConfig.layer_window`). `models/registry.py` finds the classes through each module's
``EntryClass`` and derives the architecture table from these attributes.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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
from sgl_jax.srt.layers.moe import SparseMoeBlock
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
    attention scores (Gemma 2), `in_features` the q/k/v projections' input width (default hidden_size),
    `qkv_bias` puts biases on q/k/v whatever the config says (dense Qwen2).
    """

    def __init__(self, cfg, model_config, layer_id: int, *, qk_norm: bool, dtype, rngs: nnx.Rngs,
                 mesh: Optional[Mesh] = None, norm_cls=RMSNorm, sm_scale: Optional[float] = None,
                 soft_cap: Optional[float] = None, in_features: Optional[int] = None, qkv_bias: bool = False):
        hidden = model_config.hidden_size
        q_in = in_features or hidden  # q/k/v input width (an EAGLE-3 draft layer's is 2 x hidden)
        self.num_heads = model_config.num_attention_heads
        tp = 1 if mesh is None else tp_size_of(mesh)
        self.num_kv_heads = padded_kv_heads(model_config.num_key_value_heads, tp)
        self.mesh = mesh
        self.head_dim = model_config.head_dim
        # q/k/v biases: attention_bias (Llama, Qwen3, Gemma 3: o_proj's too), Qwen2-MoE's qkv_bias, or the model
        # class's `qkv_bias` (dense Qwen2: no config flag; o_proj none)
        o_bias = bool(getattr(cfg, "attention_bias", False))
        bias = bool(o_bias or getattr(cfg, "qkv_bias", False) or qkv_bias)
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


def config_float(cfg, name: Optional[str]) -> Optional[float]:
    """The float value of config field `name`, or None when `name` is None or the field is absent or null."""
    value = None if name is None else getattr(cfg, name, None)
    return None if value is None else float(value)


NORM_PLACEMENTS = ("pre", "sandwich")  # the norm placements LlamaDecoderLayer knows (class attribute norm_placement)


class LlamaDecoderLayer(nnx.Module):
    """One decoder layer, shaped by the model class's hooks (`spec`: a `LlamaForCausalLM` subclass):

    - norm_placement "pre" (Llama, Qwen, Mixtral): x + attn(input_norm(x)), then x + mlp(post_attention_norm(x));
    - "sandwich" (Gemma 3): x + post_attention_norm(attn(input_norm(x))), then
      x + post_feedforward_norm(mlp(pre_feedforward_norm(x))).

    `mlp` is the layer's MLP, stored under ``spec.mlp_name`` (Mixtral's "block_sparse_moe"): a `LlamaMLP`, or a
    `layers.moe.SparseMoeBlock` (a bucket's padding rows skip its experts).
    """

    def __init__(self, cfg, model_config, layer_id: int, spec, mlp: nnx.Module, *, dtype, rngs: nnx.Rngs,
                 mesh: Optional[Mesh] = None):
        hidden, eps, norm = model_config.hidden_size, float(cfg.rms_norm_eps), spec.norm_cls
        scale = config_float(cfg, spec.query_scale_key)
        self.input_layernorm = norm(hidden, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(
            cfg, model_config, layer_id, qk_norm=spec.qk_norm, qkv_bias=spec.qkv_bias, dtype=dtype, rngs=rngs,
            mesh=mesh, norm_cls=norm, sm_scale=None if scale is None else scale ** -0.5,
            soft_cap=config_float(cfg, spec.attn_soft_cap_key))
        self.post_attention_layernorm = norm(hidden, eps=eps, dtype=dtype)
        if spec.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"{spec.__name__}.norm_placement must be one of {NORM_PLACEMENTS}, got "
                             f"{spec.norm_placement!r}")
        self.sandwich = spec.norm_placement == "sandwich"
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps=eps, dtype=dtype)
            self.post_feedforward_layernorm = norm(hidden, eps=eps, dtype=dtype)
        self.mlp_name = spec.mlp_name
        setattr(self, spec.mlp_name, mlp)

    def _mlp(self, h: jax.Array, fb: ForwardBatch) -> jax.Array:
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, SparseMoeBlock):
            return mlp(h, fb.real_tokens())
        return mlp(h, fb.lora_ids)

    def __call__(self, x: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        attn_out, kv = self.self_attn(self.input_layernorm(x), fb, kv)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn_out)
            return x + self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(x), fb)), kv
        x = x + attn_out
        return x + self._mlp(self.post_attention_layernorm(x), fb), kv


class LlamaModel(nnx.Module):
    """Embeddings, the decoder layers and the final norm (what `run_layers` runs); `build_mlp(i)` gives layer i's
    MLP, `spec` is the model class whose hooks shape the layers (`LlamaDecoderLayer`)."""

    def __init__(self, cfg, model_config, spec, build_mlp: Callable[[int], nnx.Module], *, dtype, rngs: nnx.Rngs,
                 mesh: Optional[Mesh] = None):
        self.embed_tokens = Embedding(model_config.vocab_size, model_config.hidden_size, dtype=dtype, rngs=rngs,
                                      quantization=getattr(model_config, "table_quant_scheme", None))
        self.layers = nnx.List([
            LlamaDecoderLayer(cfg, model_config, i, spec, build_mlp(i), dtype=dtype, rngs=rngs, mesh=mesh)
            for i in range(model_config.num_hidden_layers)
        ])
        self.norm = spec.norm_cls(model_config.hidden_size, eps=float(cfg.rms_norm_eps), dtype=dtype)


def _run_layer(graphdef, state, x, fb, kv):
    """One decoder layer from its split (`nnx.split`: graphdef, state) over x [T, hidden_size]: (x, kv, the
    layer's sown intermediates after the call: an MoE block's ``routed_ids``)."""
    layer = nnx.merge(graphdef, state)
    x, kv = layer(x, fb, kv)
    return x, kv, nnx.state(layer, nnx.Intermediate)


# Traced once per layer kind and input shapes, then its jaxpr inlined at every layer (inline=True: the same
# operations as the layers traced one by one, though XLA may fuse them in another order: SmolLM2's decode
# logprobs moved by up to 2e-5 in float32; a call boundary left in the program moved bfloat16 much more).
# The graphdef (static: structure and static attributes such as the sliding window) is jit's cache key, so layers
# that differ in anything but their parameter values trace apart. It cut bench_one_batch's tracing of SmolLM2's
# 13 start-up programs from ~9.7 s to ~6 s (reports/startup-cpu-2026-12-06.notes.md).
_layer_program = jax.jit(_run_layer, static_argnums=0, inline=True)


def run_layers(model, x: jax.Array, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
    """Every decoder layer of `model` (``.layers``, ``.norm``) over embeddings x [T, hidden_size]; returns the
    final-norm hidden states [T, hidden_size] and the updated per-layer KV caches.

    When ``model.capture_layers`` (a sorted tuple of layer ids, set by the model runner for EAGLE-3) is not empty,
    the residual stream after each of those layers (before the final norm) is concatenated in layer order into
    [T, len(ids) * hidden_size] and sown as the ``aux_hidden_states`` intermediate (`sown_aux_hidden_states`):
    SGLang's ``layers_to_capture``, where id l means the output of layer l.

    Each layer runs through `_layer_program`, so a program traces each kind of layer once, not once per layer."""
    capture = getattr(model, "capture_layers", ())
    aux, new_caches = [], []
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches)):
        graphdef, state = nnx.split(layer)
        x, kv, sown = _layer_program(graphdef, state, x, fb, kv)
        if sown:
            nnx.update(layer, sown)
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


MODEL_ROLES = ("causal", "embedding", "classifier")


class LlamaForCausalLM(nnx.Module):
    """Causal LM over the paged KV cache: the shared decoder stack. Its class attributes are the hooks a model
    file sets (see the module docstring); `models/registry.py` reads them.

    What the class serves:
        architectures: the HF ``architectures`` names built with this class.
        role: one of MODEL_ROLES. "causal": generates (an LM head, tied or not); "embedding": the decoder stack
            without a head, its final hidden states pooled (--is-embedding); "classifier": a sequence
            classification head (`classify`, /v1/rerank). An embedding or classifier model never decodes.
        is_encoder: bidirectional, every sequence whole in one step, token types (models/bert.py); an encoder's
            role is "embedding" or "classifier".
        embedding_form_of: (an "embedding" class) the causal architectures it stands in for under --is-embedding.

    Quirks (the decoder stack's hooks):
        qkv_bias: q/k/v biases whatever the config says (dense Qwen2); the config's ``attention_bias`` or
            ``qkv_bias`` also turn them on.
        qk_norm: a per-head norm on queries and keys before rotary (Qwen3, Gemma 3).
        norm_cls: the norm class (RMSNorm; Gemma's ``x * (1 + w)``); norm_placement: "pre" or "sandwich"
            (`LlamaDecoderLayer`).
        activation / activation_key: the MLP activation (a layers/activation.ACTIVATIONS name), overridden by
            config field `activation_key` when the config has it.
        query_scale_key: config field s for an attention scale of s ** -0.5 (Gemma's ``query_pre_attn_scalar``);
            None: head_dim ** -0.5.
        attn_soft_cap_key / final_soft_cap_key: config fields capping attention scores / the final logits
            (tanh soft-cap; None or a null field: none).
        scale_embeddings: embeddings times sqrt(hidden_size), in the parameter dtype (Gemma).
        tied_head_default: whether the LM head is the embedding table when the config omits
            ``tie_word_embeddings``.
        mlp_name: the attribute (and checkpoint name) of each layer's MLP; `build_mlp` builds it.

    Per-request state beyond KV (`request_states`, `request_rows`): none here; a linear-attention model declares its
    recurrent and convolution states, each a slot per request, and a vision-language model its image embeddings,
    rows per request, which the scheduler's KV memory owns (mem_cache/req_state.py).

    Args:
        model_config: `ModelConfig` (sizes, rope parameters; ``hf_config`` for the rest).
        dtype: parameter / activation dtype (jnp.float32 or jnp.bfloat16).
        rngs: initializer randomness; real weights are loaded over the initial values. None: zeros (the loader's
            abstract model, built for its shapes: layers/linear.initial_weight).
        mesh: the device mesh (distributed/mesh.py); its ``tensor`` axis shards heads, MLP width and the
            vocabulary (specs in distributed/sharding.py). None: one device, no shard_map.
    """

    architectures: Tuple[str, ...] = ("LlamaForCausalLM",)
    role = "causal"
    is_encoder = False
    embedding_form_of: Tuple[str, ...] = ()
    qkv_bias = False
    qk_norm = False
    norm_cls = RMSNorm
    norm_placement = "pre"
    activation = "silu"
    activation_key: Optional[str] = "hidden_act"
    query_scale_key: Optional[str] = None
    attn_soft_cap_key: Optional[str] = None
    final_soft_cap_key: Optional[str] = None
    scale_embeddings = False
    tied_head_default = False
    mlp_name = "mlp"

    @classmethod
    def request_states(cls, hf_config, dtype: str, tp_size: int) -> Tuple[Tuple[str, int], ...]:
        """The per-request state beyond KV a request of this model carries: ``(name, bytes per request on one
        device)`` pairs for `hf_config` in `dtype` ("float32", "bfloat16") sharded `tp_size` ways
        (``ModelConfig.req_states``; mem_cache/req_state.py). The decoder stack's state is all KV: ()."""
        del hf_config, dtype, tp_size
        return ()

    @classmethod
    def request_rows(cls, hf_config, dtype: str, tp_size: int) -> Tuple[Tuple[str, int, int], ...]:
        """The variable-size per-request state of this model: ``(name, bytes per row on one device, rows per request
        the memory budget sets aside)`` triples for `hf_config` in `dtype` sharded `tp_size` ways
        (``ModelConfig.req_rows``; mem_cache/req_state.py), e.g. a vision tower's embedding rows, one per image
        token. A text-only decoder has none: ()."""
        del hf_config, dtype, tp_size
        return ()

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.mesh = mesh
        self.model = LlamaModel(cfg, model_config, type(self),
                                lambda i: self.build_mlp(cfg, model_config, i, dtype, rngs), dtype=dtype, rngs=rngs,
                                mesh=mesh)
        tied = getattr(cfg, "tie_word_embeddings", None)
        self.tie_word_embeddings = self.role != "causal" or bool(self.tied_head_default if tied is None else tied)
        self.lm_head = None if self.tie_word_embeddings else Linear(
            model_config.hidden_size, model_config.vocab_size, dtype=dtype, rngs=rngs,
            quantization=getattr(model_config, "table_quant_scheme", None))
        self.embed_scale = float(model_config.hidden_size) ** 0.5 if self.scale_embeddings else None
        self.final_soft_cap = config_float(cfg, self.final_soft_cap_key)

    def build_mlp(self, cfg, model_config, layer_id: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `layer_id`'s MLP: a gated `LlamaMLP` of ``intermediate_size`` (models/moe.py overrides it)."""
        activation = getattr(cfg, self.activation_key, None) if self.activation_key else None
        return LlamaMLP(model_config.hidden_size, int(cfg.intermediate_size), dtype, rngs,
                        activation=activation or self.activation,
                        quantization=getattr(model_config, "quant_scheme", None), lora=lora_slots_of(model_config))

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV]) -> Tuple[jax.Array, List[LayerKV]]:
        """Run all layers.

        Args:
            fb: ForwardBatch with T tokens.
            kv_caches: one (k_pages, v_pages) per layer (donated by the caller's jit).
        Returns:
            (final-norm hidden states [T, hidden_size], updated kv_caches).
        """
        embed = self.model.embed_tokens
        x = embed(fb.input_ids)
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, embed.dtype)
        return run_layers(self.model, x, fb, kv_caches)

    def moe_routing(self):
        """(num_experts, experts per token, sparse layer indices) of a mixture-of-experts model (models/moe.py);
        None: a dense model (this one)."""
        return None

    def routed_experts(self):
        """The expert ids [L, T, k] of the last forward (models/moe.py); None: a dense model routes nothing."""
        return None

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (soft-capped when `final_soft_cap_key` says
        so)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return compute_logits(hidden, table_of(head), soft_cap=self.final_soft_cap)


class LlamaDecoderModel(LlamaForCausalLM):
    """transformers' `LlamaModel` checkpoint (the decoder stack without an LM head, tensors named without the
    ``model.`` prefix, as sentence-transformers saves decoder embedding models): served as an embedding model
    (--is-embedding), its final hidden states pooled; the embedding table stands in for the missing head."""

    architectures = ("LlamaModel",)
    role = "embedding"
    embedding_form_of = ("LlamaForCausalLM",)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """transformers' `LlamaForSequenceClassification` (``model.`` + ``score``, no LM head): a decoder reranker or
    classifier; `classify` maps the last token's final hidden state to ``num_labels`` logits (sentence-transformers'
    CrossEncoder then applies a sigmoid when there is one label)."""

    architectures = ("LlamaForSequenceClassification",)
    role = "classifier"

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        super().__init__(model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.num_labels = int(model_config.hf_config.num_labels)
        self.score = Linear(model_config.hidden_size, self.num_labels, dtype=dtype, rngs=rngs)

    def classify(self, last: jax.Array) -> jax.Array:
        """last [N, hidden] (each sequence's last token's final hidden state) -> float32 logits [N, labels]."""
        return self.score(last).astype(jnp.float32)


EntryClass = [LlamaForCausalLM, LlamaDecoderModel, LlamaForSequenceClassification]
