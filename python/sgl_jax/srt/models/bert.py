"""Encoder models: BERT (Devlin et al. 2019) and XLM-RoBERTa (Conneau et al. 2020), as transformers writes them.

Post-LayerNorm transformer layers with bidirectional attention (layers/encoder_attention.py: no KV cache, every
sequence whole in its step), learned absolute positions (XLM-RoBERTa's start at ``pad_token_id + 1``) and
token-type (segment A / B) embeddings (`ForwardBatch.token_type_ids`). Parameter names are transformers' (the
module tree mirrors `BertModel`'s), so checkpoints load as they are:

- ``BertModel`` / ``XLMRobertaModel``: the stack alone (sentence-transformers' embedding models: all-MiniLM,
  bge, bge-m3), pooled by the server (tokenizer/embedding.py); a checkpoint's ``pooler`` is not used.
- ``BertForSequenceClassification`` (``bert.`` + pooler + ``classifier``) and
  ``XLMRobertaForSequenceClassification`` (``roberta.`` + ``classifier.dense`` / ``classifier.out_proj``):
  cross-encoders (ms-marco-MiniLM, bge-reranker): `classify` maps the first token's final hidden state to
  ``num_labels`` logits.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.forward_batch import ForwardBatch
from sgl_jax.srt.layers.activation import ACTIVATIONS
from sgl_jax.srt.layers.embedding import Embedding
from sgl_jax.srt.layers.encoder_attention import EncoderMask, encoder_attention, encoder_mask
from sgl_jax.srt.layers.layernorm import LayerNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.logits_processor import compute_logits


def _linear(n_in: int, n_out: int, dtype, rngs) -> Linear:
    return Linear(n_in, n_out, use_bias=True, dtype=dtype, rngs=rngs)


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.word_embeddings = Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, h, dtype=dtype, rngs=rngs)
        self.token_type_embeddings = Embedding(max(int(getattr(cfg, "type_vocab_size", 1)), 1), h, dtype=dtype,
                                               rngs=rngs)
        self.LayerNorm = LayerNorm(h, eps=cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, ids, positions, types) -> jax.Array:
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class BertSelfAttention(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.query, self.key, self.value = (_linear(h, h, dtype, rngs) for _ in range(3))

    def __call__(self, x, mask: EncoderMask) -> jax.Array:
        t = x.shape[0]
        q, k, v = (p(x).reshape(t, self.num_heads, self.head_dim) for p in (self.query, self.key, self.value))
        return encoder_attention(q, k, v, mask, 1.0 / math.sqrt(self.head_dim)).reshape(t, -1)


class BertDenseNorm(nnx.Module):
    """dense, then LayerNorm of (the result + the residual): BertSelfOutput and BertOutput."""

    def __init__(self, n_in: int, cfg, *, dtype, rngs: nnx.Rngs):
        self.dense = _linear(n_in, cfg.hidden_size, dtype, rngs)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, x, residual) -> jax.Array:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.self = BertSelfAttention(cfg, dtype=dtype, rngs=rngs)  # (transformers' name)
        self.output = BertDenseNorm(cfg.hidden_size, cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask: EncoderMask) -> jax.Array:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.dense = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x) -> jax.Array:
        return self.act(self.dense(x))


class BertLayer(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.attention = BertAttention(cfg, dtype=dtype, rngs=rngs)
        self.intermediate = BertIntermediate(cfg, dtype=dtype, rngs=rngs)
        self.output = BertDenseNorm(cfg.intermediate_size, cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask: EncoderMask) -> jax.Array:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.layer = nnx.List([BertLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, x, mask: EncoderMask) -> jax.Array:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertStack(nnx.Module):
    """Embeddings and encoder layers (transformers' `BertModel` without its pooler): [T] tokens -> [T, hidden]."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, position_offset: int = 0, pooler: bool = False):
        self.embeddings = BertEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = BertEncoder(cfg, dtype=dtype, rngs=rngs)
        self.pooler = BertPooler(cfg, dtype=dtype, rngs=rngs) if pooler else None
        self.position_offset = position_offset

    def __call__(self, fb: ForwardBatch) -> jax.Array:
        return run_stack(self, fb)


def run_stack(stack, fb: ForwardBatch) -> jax.Array:
    """A BERT stack (``embeddings``, ``encoder``, ``position_offset``) over a step's tokens -> [T, hidden];
    attention in the step's row layout (layers/encoder_attention.py)."""
    types = fb.token_type_ids if fb.token_type_ids is not None else jnp.zeros_like(fb.input_ids)
    x = stack.embeddings(fb.input_ids, fb.positions + stack.position_offset, types)
    return stack.encoder(x, encoder_mask(fb))


class BertPooler(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size, dtype, rngs)

    def __call__(self, first: jax.Array) -> jax.Array:
        return jnp.tanh(self.dense(first))


class EncoderModel(nnx.Module):
    """What the model runner calls on an encoder (the `LlamaForCausalLM` interface): ``__call__`` gives the final
    hidden states and leaves the KV buffers as they are; `compute_logits` dots them with the word embeddings (a
    masked-LM head; serving never runs it: encoder servers serve embeddings and classification); `classify` is
    the sequence-classification head of the cross-encoders (None for the embedding forms)."""

    architectures: Tuple[str, ...] = ()  # the registry's hooks (models/llama.LlamaForCausalLM's docstring)
    role = "embedding"  # it serves embeddings and classification: no decode programs
    is_encoder = True  # the model runner gives it `ForwardBatch.token_type_ids` and the rows plan in every step
    embedding_form_of: Tuple[str, ...] = ()
    num_labels = 0

    def stack(self) -> BertStack:
        raise NotImplementedError

    def __call__(self, fb: ForwardBatch, kv_caches: List) -> Tuple[jax.Array, List]:
        """fb: T tokens of whole sequences -> (final hidden states [T, hidden], kv_caches untouched)."""
        return self.stack()(fb), kv_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden] -> float32 [N, vocab]: the tied word embeddings as an output table."""
        return compute_logits(hidden, self.stack().embeddings.word_embeddings.weight[...])

    def moe_routing(self):
        return None

    def routed_experts(self):
        return None


class BertModel(EncoderModel):
    """transformers' `BertModel` checkpoint (a sentence-transformers BERT embedding model)."""

    architectures = ("BertModel",)

    position_offset = 0

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.embeddings = BertEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = BertEncoder(cfg, dtype=dtype, rngs=rngs)

    def stack(self):
        return self

    def __call__(self, fb: ForwardBatch, kv_caches: List) -> Tuple[jax.Array, List]:
        return run_stack(self, fb), kv_caches


class XLMRobertaModel(BertModel):
    """transformers' `XLMRobertaModel` checkpoint (bge-m3): BERT's layers, positions from ``pad_token_id + 1``."""

    architectures = ("XLMRobertaModel",)

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        super().__init__(model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.position_offset = int(model_config.hf_config.pad_token_id) + 1


class BertForSequenceClassification(EncoderModel):
    """transformers' `BertForSequenceClassification`: logits = classifier(tanh(pooler(first token)))."""

    architectures = ("BertForSequenceClassification",)
    role = "classifier"

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.num_labels = int(cfg.num_labels)
        self.bert = BertStack(cfg, dtype=dtype, rngs=rngs, pooler=True)
        self.classifier = _linear(cfg.hidden_size, self.num_labels, dtype, rngs)

    def stack(self):
        return self.bert

    def classify(self, first: jax.Array) -> jax.Array:
        """first [N, hidden] (each sequence's first token's final hidden state) -> float32 logits [N, labels]."""
        return self.classifier(self.bert.pooler(first)).astype(jnp.float32)


class XLMRobertaClassificationHead(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size, dtype, rngs)
        self.out_proj = _linear(cfg.hidden_size, int(cfg.num_labels), dtype, rngs)

    def __call__(self, first: jax.Array) -> jax.Array:
        return self.out_proj(jnp.tanh(self.dense(first)))


class XLMRobertaForSequenceClassification(EncoderModel):
    """transformers' `XLMRobertaForSequenceClassification` (bge-reranker-v2-m3): logits =
    out_proj(tanh(dense(first token)))."""

    architectures = ("XLMRobertaForSequenceClassification",)
    role = "classifier"

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        self.num_labels = int(cfg.num_labels)
        self.roberta = BertStack(cfg, dtype=dtype, rngs=rngs, position_offset=int(cfg.pad_token_id) + 1)
        self.classifier = XLMRobertaClassificationHead(cfg, dtype=dtype, rngs=rngs)

    def stack(self):
        return self.roberta

    def classify(self, first: jax.Array) -> jax.Array:
        """first [N, hidden] -> float32 logits [N, labels]."""
        return self.classifier(first).astype(jnp.float32)


EntryClass = [BertModel, XLMRobertaModel, BertForSequenceClassification, XLMRobertaForSequenceClassification]
