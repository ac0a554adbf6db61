"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in transformers' LlamaRMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis.

    Args:
        dim: size of the normalized (last) axis.
        eps: added to the mean square.
        dtype: parameter dtype; the output is cast back to the input dtype.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim], same dtype as x."""
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * x32.astype(x.dtype)).astype(x.dtype)
