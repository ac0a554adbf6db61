"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half (GPT-NeoX / HF Llama) layout.

Frequency schedules follow transformers' `ROPE_INIT_FUNCTIONS`: "default", "linear" (position
interpolation) and "llama3" (Llama 3.1's piecewise frequency scaling).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, rope_parameters: dict) -> np.ndarray:
    """Inverse frequencies, float32[head_dim // 2].

    Args:
        head_dim: rotary dimension (elements).
        rope_parameters: dict with ``rope_theta``, ``rope_type`` and the type's fields (``factor``;
            for llama3 also ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    Raises:
        NotImplementedError: an unsupported ``rope_type``.
    """
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    kind = rope_parameters.get("rope_type", "default")
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if kind == "default":
        return inv_freq.astype(np.float32)
    if kind == "linear":
        return (inv_freq / float(rope_parameters["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = float(rope_parameters["factor"])
        low = float(rope_parameters["low_freq_factor"])
        high = float(rope_parameters["high_freq_factor"])
        old_ctx = float(rope_parameters["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise NotImplementedError(f"rope_type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x by its positions.

    Args:
        x: [T, num_heads, head_dim].
        positions: int32[T] absolute token positions.
        inv_freq: float32[head_dim // 2].
    Returns:
        [T, num_heads, head_dim] in x.dtype (angles computed in float32).
    """
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
