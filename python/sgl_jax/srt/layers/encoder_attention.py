"""Bidirectional attention of encoder models (BERT, XLM-RoBERTa) over one step's tokens, without a KV cache.

An encoder sees its whole sequence at once, so every sequence of a step is computed in that step (the scheduler
never splits one: tokenizer/embedding.py packs inputs to at most the largest compiled prefill and encoder servers
run without chunked prefill). A token attends to the tokens of its own sequence and, in a packed sequence, of its
own segment (`ForwardBatch.segment_starts`, the packed-scoring mask's segments), in both directions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.forward_batch import ForwardBatch


def segment_ids(fb: ForwardBatch) -> jax.Array:
    """int32[T]: one id per (sequence, segment) of the step's tokens, -1 for padding rows. Tokens attend to the
    tokens of the same id only."""
    t = fb.input_ids.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(fb.cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    real = rows < fb.cu_q_lens[fb.num_seqs]
    return jnp.where(real, seq * (t + 1) + fb.segment_starts, -1)


def encoder_attention(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, scale: float) -> jax.Array:
    """softmax(q k^T * scale) v within each segment.

    Args:
        q, k, v: [T, heads, head_dim].
        ids: int32[T] from `segment_ids`.
        scale: the logit scale (1 / sqrt(head_dim) for BERT).
    Returns:
        [T, heads, head_dim] in q's dtype; padding rows are zeros. Scores and softmax in float32 (memory
        heads x T x T floats: a dense mask, fine for the encoders' 512-token sequences).
    """
    logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    mask = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    logits = jnp.where(mask[None], logits, -1e30)
    probs = jnp.where(mask[None], jax.nn.softmax(logits, axis=-1), 0.0)
    return jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).astype(q.dtype)
