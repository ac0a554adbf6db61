"""Dense layers with HF-layout weights."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx


def dot_weight_t(x: jax.Array, w: jax.Array, preferred_element_type: Optional[jnp.dtype] = None) -> jax.Array:
    """x @ w.T for an HF-layout weight, with x cast to w's dtype.

    Args:
        x: [..., in_features]; w: [out_features, in_features]; preferred_element_type: the dot's result dtype
            (None: w's).
    Returns:
        [..., out_features].

    On CPU a single row times a bfloat16 weight is padded to two rows: XLA's CPU backend sends a one-row
    bfloat16 dot down a path ten times slower than two rows (30 x [4608, 576]: 120 ms for one row, 11 ms
    padded to two, 12 ms for one float32 row), which made a batch-1 bfloat16 decode step 5x slower than
    float32's."""
    x = x.astype(w.dtype)
    single = jax.default_backend() == "cpu" and w.dtype != jnp.float32 and math.prod(x.shape[:-1]) == 1
    if single:
        lead = x.shape[:-1]
        x = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=preferred_element_type)
    if single:
        y = y[:1].reshape(lead + (w.shape[0],))
    return y


class Linear(nnx.Module):
    """y = x @ W.T (+ b), with W stored as [out_features, in_features] like `torch.nn.Linear`.

    Keeping HF's layout makes checkpoint loading a copy (no transposes) and XLA contracts over W's
    second axis without materializing a transpose.

    Args:
        in_features, out_features: sizes in elements.
        use_bias: add a [out_features] bias.
        dtype: parameter and compute dtype.
        rngs: initializer randomness (normal, std 0.02); real weights are loaded over it.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (out_features, in_features), dtype) * 0.02)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., in_features] -> [..., out_features] in the parameter dtype.

        On CPU the product accumulates in float32 and is cast back: asked for a bfloat16 result, XLA's CPU
        backend took a path 2x slower than float32 (2048 x 576 x 1536: 19 ms), while a float32 result from
        bfloat16 operands ran 2x faster than float32 (9 ms) on a CPU with AVX512-BF16. TPU/GPU keep the
        parameter dtype's result (their dots accumulate in float32 anyway), so a tensor-parallel row layer's
        partial sums cross devices in bfloat16."""
        w = self.weight[...]
        acc = jnp.float32 if jax.default_backend() == "cpu" else None
        y = dot_weight_t(x, w, acc)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(w.dtype)
