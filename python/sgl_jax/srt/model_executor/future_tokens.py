"""The future-token buffer of the overlap scheduler: a step's input tokens that the step before it is still sampling.

With overlap on (SGLang's default; ``--disable-overlap-schedule`` turns it off), the scheduler builds and launches
decode step n+1 while step n runs on the device, before step n's sampled tokens reach the host. A row of step n+1
whose input is such a token carries the placeholder ``-(slot + 1)`` instead, ``slot`` being its request's row of
the stacked request slots (rank r's slot s is ``r * num_request_slots + s``, the rows of the penalty state). Step n
writes each sampled token to ``future[slot]`` on the device; step n+1 reads it there before its forward. The two
steps are ordered on the device because the buffer (like the KV cache) is a donated input and output of every step,
so no host sync sits between them. Upstream sglang-jax's ``FutureMap`` and SGLang's pool-indexed relay do the same
(both index the buffer by request slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def new_future_tokens(num_slots: int) -> jax.Array:
    """int32[num_slots] zeros: one sampled token per stacked request slot."""
    return jnp.zeros((num_slots,), jnp.int32)


def resolve_placeholders(ids: jax.Array, future: jax.Array) -> jax.Array:
    """int32 token ids with every placeholder ``-(slot + 1)`` replaced by ``future[slot]`` (real ids, >= 0, as they
    are). Shapes: ids any, future int32[num_slots]."""
    slot = jnp.clip(-ids - 1, 0, future.shape[0] - 1)
    return jnp.where(ids < 0, future[slot], ids)


def write_future(future: jax.Array, slots: jax.Array, writes: jax.Array, next_ids: jax.Array) -> jax.Array:
    """`future` with ``future[slots[i]] = next_ids[i]`` for the rows where ``writes[i]`` (int32[S] slots, bool[S]
    writes, int32[S] next_ids; other rows, padding included, write nothing: two rows never write one slot)."""
    target = jnp.where(writes, slots, future.shape[0])
    return future.at[target].set(next_ids, mode="drop")
