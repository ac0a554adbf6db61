"""Next-token logits from final hidden states (shared by all models)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear import dot_weight_t, group_quantized_matmul


def compute_logits(hidden: jax.Array, lm_head_weight, soft_cap: Optional[float] = None) -> jax.Array:
    """Logits = hidden @ W.T, accumulated in float32.

    Args:
        hidden: [N, hidden_size] final-norm hidden states (only the rows whose logits are needed).
        lm_head_weight: [vocab_size, hidden_size] (the LM head, or the embedding table when tied), or a quantized
            one as (int8 / fp8 values, float32 scales [vocab_size, groups] or [vocab_size]) (`embedding.Table`):
            the dot runs on the quantized values, weight-only (hidden stays in its dtype), and the scales
            multiply its float32 result per group (`linear.group_quantized_matmul`) or per row.
        soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (Gemma 2's final soft-cap).
    Returns:
        float32 [N, vocab_size].
    """
    if not isinstance(lm_head_weight, tuple):
        logits = dot_weight_t(hidden, lm_head_weight, jnp.float32)
    elif lm_head_weight[1].ndim == 2:
        logits = group_quantized_matmul(hidden, *lm_head_weight)
    else:
        q, scale = lm_head_weight
        logits = dot_weight_t(hidden, q.astype(hidden.dtype), jnp.float32) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits
