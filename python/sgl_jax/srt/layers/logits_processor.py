"""Next-token logits from final hidden states (shared by all models)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear import dot_weight_t


def compute_logits(hidden: jax.Array, lm_head_weight: jax.Array, soft_cap: Optional[float] = None) -> jax.Array:
    """Logits = hidden @ W.T, accumulated in float32.

    Args:
        hidden: [N, hidden_size] final-norm hidden states (only the rows whose logits are needed).
        lm_head_weight: [vocab_size, hidden_size] (the LM head, or the embedding table when tied).
        soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (Gemma 2's final soft-cap).
    Returns:
        float32 [N, vocab_size].
    """
    logits = dot_weight_t(hidden, lm_head_weight, jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits
