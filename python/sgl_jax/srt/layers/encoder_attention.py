"""Bidirectional attention of encoder models (BERT, XLM-RoBERTa) over one step's tokens, without a KV cache.

An encoder sees its whole sequence at once, so every sequence of a step is computed in that step (the scheduler
never splits one: tokenizer/embedding.py packs inputs to at most the largest compiled prefill and encoder servers
run without chunked prefill). A token attends to the tokens of its own sequence and, in a packed sequence, of its
own segment (`ForwardBatch.segment_starts`, the packed-scoring mask's segments), in both directions.

Computed over the whole step with a mask, a step of T tokens costs T^2 scores per head, while its segments need
only the sum of their squares (a 512-token step of 13 sentences: 512^2 against ~18k). So the step's tokens are
laid out in rows first (`plan_rows`, on the host, when the model runner builds the step): its segments placed
first-fit-decreasing into the T / R rows of R tokens, none split, the padding rows filling the gaps. The encoder
permutes its hidden states into that order once after the embeddings (`to_rows`) and back after the last layer
(`from_rows`); every layer between works on the permuted rows as on any others, and attention is computed per row
of R (T R scores) without moving anything. Each step bucket has a few static row lengths (`row_layouts`); the plan
picks the smallest that takes every segment, else the identity order and the whole-step masked form; every
attention holds all of them as branches of one `jax.lax.switch`, so no step compiles anything. The results are the
same in every form (the same keys per query; sums in another order): the layout only saves work.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.forward_batch import ForwardBatch

# row lengths tried, smallest first; a step bucket uses those under its own length that divide it
ROW_SIZES = (64, 128, 256, 384, 512, 768, 1024, 2048)
_MASKED = -1e30
QUERY_BLOCK = 128  # queries per block of a long row's scores (`_attend`)


def row_layouts(t_pad: int) -> Tuple[int, ...]:
    """The row lengths R of a step of `t_pad` tokens (t_pad / R rows each), ascending: every R of ROW_SIZES under
    t_pad that divides it."""
    return tuple(r for r in ROW_SIZES if r < t_pad and t_pad % r == 0)


def step_segments(cu_q_lens: np.ndarray, num_seqs: int, segment_starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(start row, length) int64 arrays of the step's segments: each sequence's runs of equal
    ``segment_starts`` (a packed sequence's inputs; an ordinary sequence is one segment)."""
    total = int(cu_q_lens[num_seqs])
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.arange(total)
    seq = np.searchsorted(np.asarray(cu_q_lens[1:num_seqs + 1]), rows, side="right")
    ids = seq * (len(segment_starts) + 1) + np.asarray(segment_starts[:total], np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1])
    return starts, np.diff(np.append(starts, total))


def plan_rows(starts: Sequence[int], lengths: Sequence[int], t_pad: int) -> Tuple[int, np.ndarray]:
    """Lay a step's tokens out in rows (module docstring).

    Args:
        starts, lengths: each segment's first row in the step and its tokens (`step_segments`); the segments
            cover the step's first sum(lengths) rows, the rest are padding.
        t_pad: the step's padded tokens.
    Returns:
        (branch, order): branch i < len(row_layouts(t_pad)) is row length row_layouts(t_pad)[i],
        len(row_layouts(t_pad)) the whole-step form; order int32[t_pad], a permutation: the step row at each
        position of the layout (row j of length R at [j R, (j + 1) R)); the identity for the whole-step form.
    """
    layouts = row_layouts(t_pad)
    longest = max(lengths, default=0)
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for branch, r in enumerate(layouts):
        if longest > r:
            continue
        n = t_pad // r
        free, rows = [r] * n, [[] for _ in range(n)]
        for i in by_length:
            row = next((j for j in range(n) if free[j] >= lengths[i]), None)
            if row is None:
                break
            rows[row].append(i)
            free[row] -= lengths[i]
        else:
            order = np.full(t_pad, -1, np.int32)
            for j in range(n):
                at = j * r
                for i in rows[j]:
                    order[at:at + lengths[i]] = np.arange(starts[i], starts[i] + lengths[i])
                    at += lengths[i]
            order[order < 0] = np.arange(sum(lengths), t_pad)  # the padding rows fill each row's rest
            return branch, order
    return len(layouts), np.arange(t_pad, dtype=np.int32)


def with_encoder_inputs(fb: ForwardBatch) -> ForwardBatch:
    """An encoder step's host ForwardBatch with what the encoder reads in every step: ``token_type_ids`` (zeros
    where it has none) and its row layout (``encoder_branch``, ``encoder_rows``: `plan_rows` of its segments)."""
    t_pad = int(np.shape(fb.input_ids)[0])
    types = fb.token_type_ids if fb.token_type_ids is not None else np.zeros(t_pad, np.int32)
    starts, lengths = step_segments(np.asarray(fb.cu_q_lens), int(fb.num_seqs), np.asarray(fb.segment_starts))
    branch, order = plan_rows(starts.tolist(), lengths.tolist(), t_pad)
    return dataclasses.replace(fb, token_type_ids=types, encoder_branch=np.asarray([branch], np.int32),
                               encoder_rows=order)


class EncoderMask(NamedTuple):
    """What encoder attention needs of a step, in the order of its row layout: ids int32[T] (`segment_ids`
    permuted), branch int32[] (`plan_rows`; None: always the whole-step form)."""

    ids: jax.Array
    branch: jax.Array = None


def segment_ids(fb: ForwardBatch) -> jax.Array:
    """int32[T]: one id per (sequence, segment) of the step's tokens, -1 for padding rows. Tokens attend to the
    tokens of the same id only."""
    t = fb.input_ids.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(fb.cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    real = rows < fb.cu_q_lens[fb.num_seqs]
    return jnp.where(real, seq * (t + 1) + fb.segment_starts, -1)


def encoder_layout(fb: ForwardBatch) -> Tuple[EncoderMask, jax.Array]:
    """(the step's EncoderMask, its row order int32[T] or None): from `ForwardBatch.encoder_rows` when the model
    runner planned the rows, else the step's own order and the whole-step form."""
    ids = segment_ids(fb)
    if fb.encoder_rows is None:
        return EncoderMask(ids), None
    return EncoderMask(ids[fb.encoder_rows], fb.encoder_branch[0]), fb.encoder_rows


def to_rows(x: jax.Array, order) -> jax.Array:
    """x [T, ...] in the step's order -> in the row layout's (`encoder_layout`; None: unchanged)."""
    return x if order is None else x[order]


def from_rows(x: jax.Array, order) -> jax.Array:
    """x [T, ...] in the row layout's order -> back in the step's (the inverse of `to_rows`)."""
    return x if order is None else jnp.zeros_like(x).at[order].set(x)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q, k, v float32 [n, L, heads, head_dim] (q already scaled), mask bool[n, L, L] -> [n, L, heads, head_dim]:
    softmax(q k^T) v over the allowed keys; a row with none gets some finite value. The heads are moved next to
    the rows first, so that both products are one batched matmul of n x heads (on XLA's CPU backend this ran
    the attention of a 512-token step 1.3-2.5x faster than einsums over [n, L, heads, head_dim]); rows longer
    than QUERY_BLOCK go through in blocks of that many queries (`jax.lax.map`), so that no layout's scores take
    more than n x heads x QUERY_BLOCK x L floats (a branch of a `jax.lax.switch` holding a whole 768-token step's
    scores slowed every other branch ~1.8x on XLA's CPU backend, taken or not)."""
    n, length, heads, dim = q.shape
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [n, heads, L, head_dim]
    kt = jnp.swapaxes(k, -1, -2)

    def block(qb, mb):  # qb [n, heads, B, head_dim], mb [n, B, L]
        logits = jnp.where(mb[:, None], jnp.matmul(qb, kt), _MASKED)
        p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        return jnp.matmul(p, v) / jnp.sum(p, axis=-1, keepdims=True)

    if length <= QUERY_BLOCK or length % QUERY_BLOCK:
        out = block(q, mask)
    else:
        nb = length // QUERY_BLOCK
        qb = jnp.moveaxis(q.reshape(n, heads, nb, QUERY_BLOCK, dim), 2, 0)
        mb = jnp.moveaxis(mask.reshape(n, nb, QUERY_BLOCK, length), 1, 0)
        out = jax.lax.map(lambda a: block(*a), (qb, mb))  # [nb, n, heads, B, head_dim]
        out = jnp.moveaxis(out, 0, 2).reshape(n, heads, length, dim)
    return jnp.swapaxes(out, 1, 2)


def _in_rows(r: int):
    def attend(q, k, v, ids):
        t, heads, dim = q.shape
        sid = ids.reshape(t // r, r)
        mask = (sid[:, :, None] == sid[:, None, :]) & (sid[:, :, None] >= 0)
        return _attend(*(x.reshape(t // r, r, heads, dim) for x in (q, k, v)), mask).reshape(t, heads, dim)
    return attend


def encoder_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: EncoderMask, scale: float) -> jax.Array:
    """softmax(q k^T * scale) v within each segment.

    Args:
        q, k, v: [T, heads, head_dim], in the row layout's order (`to_rows`).
        mask: the step's EncoderMask (`encoder_layout`).
        scale: the logit scale (1 / sqrt(head_dim) for BERT).
    Returns:
        [T, heads, head_dim] in q's dtype and order; padding rows are zeros. Scores and softmax in float32.
    """
    dtype = q.dtype
    q, k, v = q.astype(jnp.float32) * scale, k.astype(jnp.float32), v.astype(jnp.float32)
    layouts = row_layouts(q.shape[0])
    if mask.branch is None or not layouts:
        out = _in_rows(q.shape[0])(q, k, v, mask.ids)  # (one row: the whole step)
    else:
        out = jax.lax.switch(mask.branch, [_in_rows(r) for r in layouts + (q.shape[0],)], q, k, v, mask.ids)
    return jnp.where((mask.ids >= 0)[:, None, None], out, 0.0).astype(dtype)
