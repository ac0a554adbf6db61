"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in transformers' LlamaRMSNorm; LayerNorm for the encoders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


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
        return (self.weight[...] * _normalized(x, self.eps).astype(x.dtype)).astype(x.dtype)


class GemmaRMSNorm(nnx.Module):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's dtype
    (transformers' `Gemma3RMSNorm`). The stored ``weight`` is the offset from 1 (zeros = identity scale).

    Args:
        dim: size of the normalized (last) axis.
        eps: added to the mean square.
        dtype: parameter dtype.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim], same dtype as x."""
        return (_normalized(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm (Ba et al. 2016) with ``weight`` and ``bias`` (HF's names): y = (x - mean) / sqrt(var + eps) *
    weight + bias over the last axis, computed in float32 and cast back to x's dtype (transformers' BERT and
    XLM-RoBERTa use torch's nn.LayerNorm, eps from ``layer_norm_eps``).

    Args:
        dim: size of the normalized (last) axis.
        eps: added to the variance.
        dtype: parameter dtype.
    """

    def __init__(self, dim: int, *, eps: float = 1e-12, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim], same dtype as x."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
