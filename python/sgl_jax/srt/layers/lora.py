"""The batched LoRA update of a linear layer: every token adds ``B[s] (A[s] x)`` of its request's adapter slot s.

The adapters of a batch sit in fixed device slots (`lora_a` [n, R, in], `lora_b` [n, R, out], rank padded to R
with zeros, PEFT's scaling folded into B: srt/lora/), so loading an adapter writes data and never changes the
compiled program. Each token carries its slot id (`ForwardBatch.lora_ids`, -1: no adapter) and the update is
computed in the same jit as the base matmul (Punica's / SGLang's segmented gather-matmul idea: Chen et al.,
"Punica: Multi-Tenant LoRA Serving", 2023). Two ways, ``--lora-backend``:

- ``dense``: x times every slot's A at once ([T, n R], one matmul), the columns of other slots zeroed, times
  every slot's B ([n R, out], one matmul). It costs 2 T n R (in + out) flops whatever the mix.
- ``ragged``: tokens sorted by slot and each run multiplied by its own slot's A and B with
  `jax.lax.ragged_dot` (2 T R (in + out) flops), then put back in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LORA_BACKENDS = ("dense", "ragged")


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, ids: jax.Array, backend: str = "dense") -> jax.Array:
    """The LoRA update of one linear layer for a batch of tokens.

    Args:
        x: [T, in] activations.
        a: [n, R, in] every slot's A; b: [n, R, out] every slot's B transposed, scaling included (both
            layouts make the dense backend's two products plain [T, k] x [k, m] matrix products, with no
            transposed copy of the slots per call).
        ids: int32[T] each token's slot, -1 for none (its update is 0).
        backend: one of `LORA_BACKENDS` (module docstring).
    Returns:
        float32 [T, out].
    Raises:
        ValueError: an unknown backend.
    """
    n, r, k = a.shape
    x = x.astype(a.dtype)
    if backend == "dense":
        xa = jax.lax.dot_general(x, a.reshape(n * r, k), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [T, n R]
        mine = (ids[:, None] == jnp.arange(n, dtype=ids.dtype)[None, :]).astype(jnp.float32)  # [T, n]
        xa = (xa.reshape(-1, n, r) * mine[:, :, None]).reshape(-1, n * r).astype(b.dtype)
        return jax.lax.dot_general(xa, b.reshape(n * r, -1), (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    if backend == "ragged":
        group = jnp.where(ids < 0, n, ids)  # no adapter: an extra group of zero weights
        order = jnp.argsort(group, stable=True)
        sizes = jnp.bincount(group, length=n + 1).astype(jnp.int32)
        a_t = jnp.concatenate([a, jnp.zeros((1, r, k), a.dtype)]).transpose(0, 2, 1)  # [n + 1, in, R]
        b_t = jnp.concatenate([b, jnp.zeros((1,) + b.shape[1:], b.dtype)])  # [n + 1, R, out]
        xa = jax.lax.ragged_dot(x[order], a_t, sizes, preferred_element_type=jnp.float32)
        y = jax.lax.ragged_dot(xa.astype(b.dtype), b_t, sizes, preferred_element_type=jnp.float32)
        return jnp.zeros_like(y).at[order].set(y)
    raise ValueError(f"--lora-backend must be one of {list(LORA_BACKENDS)}, got {backend!r}")
