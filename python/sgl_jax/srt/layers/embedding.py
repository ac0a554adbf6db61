"""Token embedding whose table can double as a tied LM head."""

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

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [N, hidden_size] -> float32 logits [N, vocab_size]."""
        w = self.weight[...]
        return jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
