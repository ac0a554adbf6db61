"""Flash-decoding: the parts of the Pallas decode kernels (`gpu_decode`, `tpu_decode`) that run in XLA around them.

A decode batch has one query token per sequence. The kernels give each (sequence, KV head, context split) its own
program, with the GQA group's query heads as the rows of the dots (so a K/V row is read once for the whole group),
and each program walks only its split of the context: the grid has enough programs to fill the device even at
batch 1 (Dao, Haziza, Massa and Sizov 2023, "Flash-Decoding for long-context inference"; FlashInfer's and vLLM's
split-KV decode). Each program writes its unnormalised softmax state (running max m, sum l, accumulator acc) and
`combine` merges the splits.

Layouts (N = S * KVH * num_splits programs, program n = (s * KVH + h) * num_splits + j; R query rows per program):
queries [S * KVH * R, D] (the group's G heads, then zero rows up to R), partial m and l float32 [N * R, 1],
partial acc float32 [N * R, D].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Tile sizes of a decode launch.

    block_kv: KV tokens per inner step of a program (rounded to whole pages by the TPU kernel).
    split_tokens: KV tokens per program (a multiple of block_kv): a sequence of L tokens gets ceil(L / split_tokens)
        programs with work per KV head. The split depends only on the token position, so a sequence's result does
        not depend on the rest of the batch, except through the grid's padded width.
    """

    block_kv: int
    split_tokens: int

    def __post_init__(self):
        if self.block_kv < 1 or self.split_tokens < self.block_kv or self.split_tokens % self.block_kv:
            raise ValueError(f"split_tokens {self.split_tokens} must be a positive multiple of block_kv "
                             f"{self.block_kv}")


def query_rows(group: int, minimum: int) -> int:
    """Rows per program: the GQA group size rounded up to a power of two, at least `minimum` (Triton's dots need 16
    rows, Mosaic's 8)."""
    rows = minimum
    while rows < group:
        rows *= 2
    return rows


def num_splits(pages_per_seq: int, page_size: int, split_tokens: int) -> int:
    """Programs per (sequence, KV head): the most a sequence of the batch can need (static: from the page table's
    width)."""
    return max(1, -(-pages_per_seq * page_size // split_tokens))


def live_kv_lens(kv_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """int32[S]: kv_lens with the padding sequences (index >= num_seqs) set to 0, so that their programs do
    nothing."""
    S = kv_lens.shape[0]
    return jnp.where(jnp.arange(S) < jnp.asarray(num_seqs, jnp.int32).reshape(()), kv_lens, 0).astype(jnp.int32)


def decode_queries(q: jax.Array, num_seqs_pad: int, num_kv_heads: int, rows: int, sm_scale: float) -> jax.Array:
    """The kernels' query rows: q [T, H, D] (row s is sequence s's token) -> [S * KVH * rows, D] in q.dtype, scaled
    by sm_scale (in float32, then rounded to q.dtype, as the extend kernels do), the G = H / KVH heads of KV head h
    at rows [(s * KVH + h) * rows, ... + G), zeros after them."""
    T, H, D = q.shape
    G = H // num_kv_heads
    idx = jnp.minimum(jnp.arange(num_seqs_pad), T - 1)
    qs = (q[idx].astype(jnp.float32) * sm_scale).reshape(num_seqs_pad, num_kv_heads, G, D)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    return qs.astype(q.dtype).reshape(num_seqs_pad * num_kv_heads * rows, D)


def combine(m: jax.Array, l: jax.Array, acc: jax.Array, q: jax.Array, num_seqs: jax.Array, num_seqs_pad: int,
            num_kv_heads: int, splits: int) -> jax.Array:
    """Merge the programs' partial softmax states into the attention output.

    Args:
        m, l: float32[N * R, 1]; acc: float32[N * R, D] (see the module's layout, N = num_seqs_pad * num_kv_heads *
            splits); q: the [T, H, D] query (for the output's shape and dtype); num_seqs: int32 scalar.
    Returns:
        [T, H, D] in q.dtype: row s holds sequence s's output for s < min(num_seqs, T), every other row is zero
        (the contract of `ref.ragged_paged_attention` with ``decode_only=True``).
    """
    T, H, D = q.shape
    S = num_seqs_pad
    R = acc.shape[0] // (S * num_kv_heads * splits)
    m = m.reshape(S, num_kv_heads, splits, R)
    l = l.reshape(S, num_kv_heads, splits, R)
    acc = acc.reshape(S, num_kv_heads, splits, R, D)
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_max), 0.0)
    den = (w * l).sum(axis=2)
    o = (w[..., None] * acc).sum(axis=2) / jnp.where(den > 0, den, 1.0)[..., None]  # [S, KVH, R, D]
    o = o[:, :, :H // num_kv_heads].reshape(S, H, D).astype(q.dtype)
    dest = jnp.where(jnp.arange(S) < jnp.asarray(num_seqs, jnp.int32).reshape(()), jnp.arange(S), T)
    return jnp.zeros_like(q).at[dest].set(o, mode="drop")
