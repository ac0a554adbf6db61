"""Token embedding (its table doubles as the LM head when embeddings are tied)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embedding(nnx.Module):
    """Lookup table ``weight`` [vocab_size, hidden_size] (HF layout and name)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, hidden_size), dtype) * 0.02)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids: int32[T] -> [T, hidden_size]."""
        return jnp.take(self.weight[...], ids, axis=0)
